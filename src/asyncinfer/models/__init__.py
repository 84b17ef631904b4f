"""Model implementations, looked up by the architecture name in config.json.

The registry (and with it torch) loads on first use of its names, so the modules that find,
fetch and list models (``source``, ``fetch``, ``convert``) load without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncinfer.models.registry import MODEL_REGISTRY, build_model, check_model

__all__ = ["MODEL_REGISTRY", "build_model", "check_model"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from asyncinfer.models import registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
