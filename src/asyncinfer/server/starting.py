"""What the port answers while the server starts: 503 naming the step, with Retry-After.

The server binds its port first and serves this until the engine core is loaded and the
front is ready, so a first request is answered at once, never left hanging. See
docs/architecture.md, "Server processes and stopping".
"""

from __future__ import annotations

import socket

from aiohttp import web

from asyncinfer.server.errors import error_body

RETRY_AFTER = 5  # seconds: a model loads in seconds at best, a first fetch in minutes


class Starting:
    """A small app on a duplicate of the listening socket: /health is 503 ``{"status":
    "starting", "step": ...}``, every other route 503 ``server_starting``. Closing it
    leaves the listening socket open: connections wait there for the real app."""

    def __init__(self, step: str) -> None:
        self.step = step
        self._runner: web.AppRunner | None = None

    def set_step(self, step: str) -> None:
        """The step now under way (from any thread: one assignment)."""
        self.step = step

    async def open(self, listener: socket.socket, header_timeout: float) -> None:
        app = web.Application(handler_args={"auto_decompress": False})
        app.router.add_route("*", "/{path:.*}", self._answer)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None,
                                     keepalive_timeout=header_timeout, lingering_time=1.0,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        await web.SockSite(self._runner, listener.dup()).start()

    async def close(self) -> None:
        """Stop answering (idempotent); the listening socket stays open."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _answer(self, request: web.Request) -> web.Response:
        headers = {"Retry-After": str(RETRY_AFTER)}
        if request.path == "/health":
            return web.json_response({"status": "starting", "step": self.step}, status=503,
                                     headers=headers)
        body = error_body(503, f"the server is starting ({self.step}); retry in "
                               f"{RETRY_AFTER} s", code="server_starting")
        return web.json_response(body, status=503, headers=headers)
