"""asyncinfer: an LLM inference engine with swappable scheduling policies.

The public names load on first use, so ``import asyncinfer.policies`` and the CLI's
``--help`` do not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncinfer.api import LLM, AsyncEngine, RequestOutput, SamplingParams, StreamDelta

__all__ = ["LLM", "AsyncEngine", "RequestOutput", "SamplingParams", "StreamDelta"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in __all__:
        from asyncinfer import api

        return getattr(api, name)
    raise AttributeError(f"module 'asyncinfer' has no attribute {name!r}")
