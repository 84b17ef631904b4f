"""The OpenAI-compatible HTTP server: ``create_app(backend)`` and ``serve(args)``.

Attributes are imported on first use, so ``asyncinfer --help`` does not load aiohttp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncinfer.server.app import create_app
    from asyncinfer.server.cli import serve

__all__ = ["create_app", "serve"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from asyncinfer.server.app import create_app

        return create_app
    if name == "serve":
        from asyncinfer.server.cli import serve

        return serve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
