"""``asyncinfer serve``: build the engine from the command line and run the app on it.

SIGTERM or SIGINT drains the server (see :func:`asyncinfer.server.app.drain`): it stops
admitting, lets requests in flight finish for ``--shutdown-timeout`` seconds, ends the rest,
then closes the engine and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import TYPE_CHECKING, Any

from aiohttp import web

from asyncinfer.options import engine_options

if TYPE_CHECKING:
    from asyncinfer.server.app import ServerOptions

logger = logging.getLogger(__name__)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop when uvloop is installed, else asyncio's default."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def server_options(args: argparse.Namespace) -> ServerOptions:
    """The server's limits and timeouts from the command line."""
    from asyncinfer.server.app import ServerOptions

    return ServerOptions(max_waiting_requests=args.max_waiting_requests,
                         default_max_tokens=args.default_max_tokens,
                         max_tokens_limit=args.max_tokens_limit,
                         body_timeout=args.body_timeout,
                         special_tokens_in_text=args.special_tokens_in_text)


def serve(args: argparse.Namespace) -> int:
    """Load the model, then serve it on ``args.host:args.port`` until SIGTERM or SIGINT."""
    from asyncinfer.api import AsyncEngine

    engine = AsyncEngine(**engine_options(args))
    loop = new_event_loop()
    try:
        loop.run_until_complete(_serve(engine, args))
    finally:
        loop.close()
    return 0


def app_runner(app: web.Application, header_timeout: float) -> web.AppRunner:
    """The runner ``serve`` uses: a client that disconnects has its handler cancelled (so its
    request is aborted at once), and a connection that sends no complete request head within
    ``header_timeout`` seconds, or idles that long between requests, is closed. After an
    error answered before its body was read (408, 413), the connection lingers at most 2 s
    for the rest of the body. At exit, after the drain, handlers get 5 s more."""
    return web.AppRunner(app, handler_cancellation=True, keepalive_timeout=header_timeout,
                         lingering_time=2.0, shutdown_timeout=5.0)


async def _serve(engine: Any, args: argparse.Namespace) -> None:
    from asyncinfer.server.app import create_app, drain

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await engine.start()
    try:
        app = create_app(engine, api_key=args.api_key, served_model_name=args.served_model_name,
                         options=server_options(args))
    except BaseException:
        await engine.close()
        raise
    runner = app_runner(app, args.header_timeout)
    try:
        await runner.setup()
        # A burst of clients must not overflow the accept queue (aiohttp's default is 128).
        site = web.TCPSite(runner, args.host, args.port, backlog=4096)
        await site.start()
        logger.info("serving %s on http://%s:%d", args.served_model_name or engine.model_name,
                    args.host, args.port)
        print(f"asyncinfer: serving on http://{args.host}:{args.port} (Ctrl-C to stop)",
              flush=True)
        await stop.wait()
        logger.info("shutting down: draining for up to %g s", args.shutdown_timeout)
        await drain(app, args.shutdown_timeout)
    finally:
        await runner.cleanup()
        await engine.close()
