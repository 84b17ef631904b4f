"""``asyncinfer serve``: build the engine from the command line and run the app on it."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

logger = logging.getLogger(__name__)

# Command-line flag (argparse dest) → engine option; only flags the user gave are passed.
ENGINE_FLAGS = ("dtype", "device", "page_size", "max_running_requests", "max_extend_tokens",
                "cache_type", "kv_cache_gb", "max_seq_len", "load_format",
                "attention_backend", "gpu_memory_utilization", "cuda_graph_max_bs")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine keyword options the command line sets (defaults left to the engine)."""
    options = {name: getattr(args, name) for name in ENGINE_FLAGS
               if getattr(args, name, None) is not None}
    if getattr(args, "no_chunked_prefill", False):
        options["chunked_prefill"] = False
    if getattr(args, "no_cuda_graph", False):
        options["cuda_graph"] = False
    if getattr(args, "no_torch_compile", False):
        options["torch_compile"] = False
    return options


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop when uvloop is installed, else asyncio's default."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def serve(args: argparse.Namespace) -> int:
    """Load the model, then serve it on ``args.host:args.port`` until interrupted."""
    from asyncinfer.api import AsyncEngine
    from asyncinfer.policies.registry import parse_policy_options
    from asyncinfer.server.app import create_app

    engine = AsyncEngine(args.model, policy=args.policy,
                         policy_options=parse_policy_options(args.policy_opt or []),
                         overlap=not args.no_overlap, **engine_options(args))

    async def engine_lifetime(app: web.Application) -> AsyncIterator[None]:
        await engine.start()
        yield
        await engine.close()

    app = create_app(engine, api_key=args.api_key, served_model_name=args.served_model_name)
    app.cleanup_ctx.append(engine_lifetime)
    logger.info("serving %s on http://%s:%d", args.served_model_name or engine.model_name,
                args.host, args.port)
    # Cancel the handler of a client that disconnects, so its request is aborted at once.
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True,
                loop=new_event_loop())
    return 0
