"""Operating one server: admission, the outcome count, health, the drain, and the API key."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web
from attrs import define

from asyncinfer.errors import EngineError
from asyncinfer.params import SamplingParams
from asyncinfer.server.backend import GenerateBackend
from asyncinfer.server.errors import CLIENT_CLOSED, APIError, http_status
from asyncinfer.server.metrics import ServerMetrics
from asyncinfer.server.options import ServerOptions

logger = logging.getLogger(__name__)


@define
class ServerState:
    """What handlers and the shutdown share: draining, and the generation requests in flight."""

    draining: bool = False
    ready: bool = True                  # False: /health says 503, work is still served
    in_flight: int = 0
    admitting: int = 0                  # admitted, not yet handed to the engine
    idle: asyncio.Event | None = None

    def enter(self) -> None:
        self.in_flight += 1
        self._idle().clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle().set()

    def _idle(self) -> asyncio.Event:
        if self.idle is None:
            self.idle = asyncio.Event()
            if self.in_flight == 0:
                self.idle.set()
        return self.idle

    async def wait_idle(self) -> None:
        """Return once no generation request is in flight."""
        await self._idle().wait()


METRICS = web.AppKey("metrics", ServerMetrics)
STATE = web.AppKey("state", ServerState)
BACKEND = web.AppKey("backend", GenerateBackend)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@define
class Call:
    """One generation request in flight: the HTTP request and how it ended (metrics.OUTCOMES)."""

    request: web.Request
    outcome: str | None = None


CallHandler = Callable[[Call], Awaitable[web.StreamResponse]]


class Operations:
    """Admission, health and the outcome count of one app's generation requests."""

    def __init__(self, backend: GenerateBackend, options: ServerOptions, state: ServerState,
                 metrics: ServerMetrics) -> None:
        self.backend, self.options, self.state, self.metrics = backend, options, state, metrics

    def counted(self, handler: CallHandler) -> Handler:
        """``handler`` admitted, tracked while in flight, and counted once by outcome."""

        async def run(request: web.Request) -> web.StreamResponse:
            call = Call(request)
            self.state.enter()
            try:
                self.admit()
                response = await handler(call)
            except asyncio.CancelledError:
                self.metrics.record_outcome(call.outcome or "cancelled")
                raise
            except Exception as exc:
                # How the engine ended the request, if it did; else what the status says.
                self.metrics.record_outcome(call.outcome or _outcome(http_status(exc)))
                raise
            finally:
                self.state.leave()
            self.metrics.record_outcome(call.outcome or "failed")
            return response

        return run

    def admit(self) -> None:
        """503 with Retry-After while draining, with the engine down, or past
        ``max_waiting_requests`` (those parsing count as waiting)."""
        if self.state.draining:
            raise self.shutting_down()
        if not self.backend.alive:
            raise APIError(503, "the engine is not running", code="engine_unavailable",
                           headers=self._retry())
        waiting = self.backend.stats().waiting + self.state.admitting
        limit = self.options.max_waiting_requests
        if waiting >= limit:
            raise APIError(503, f"the server is full: {waiting} requests are waiting (the "
                                f"limit is {limit}); retry later",
                           code="server_overloaded", headers=self._retry())

    @contextlib.contextmanager
    def admitting(self) -> Iterator[None]:
        """Count a body being read and tokenized as waiting; refuse it if a drain began."""
        self.state.admitting += 1
        try:
            yield
        finally:
            self.state.admitting -= 1
        if self.state.draining:
            raise self.shutting_down()

    def shutting_down(self) -> APIError:
        return APIError(503, "the server is shutting down", code="server_shutting_down",
                        headers=self._retry())

    def _retry(self) -> dict[str, str]:
        return {"Retry-After": str(self.options.retry_after)}

    async def health(self, request: web.Request) -> web.Response:
        """200 while the engine runs and the server accepts work; 503 from a shutdown's start."""
        if self.state.draining:
            return web.json_response({"status": "draining"}, status=503)
        if not self.state.ready:
            return web.json_response({"status": "shutting down"}, status=503)
        if not self.backend.alive:
            return web.json_response({"status": "engine stopped"}, status=503)
        return web.json_response({"status": "ok"})


    async def health_generate(self, request: web.Request) -> web.Response:
        """200 once the engine has generated one token (of a one-token prompt) within
        ``health_generate_timeout``; 503 when it cannot: draining, engine stopped, or no
        token in time (a stalled or overloaded engine)."""
        if self.state.draining or not self.backend.alive:
            return await self.health(request)
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        timeout = self.options.health_generate_timeout
        try:
            out = await asyncio.wait_for(self.backend.generate([0], params), timeout)
        except asyncio.TimeoutError:
            return web.json_response({"status": f"no token within {timeout:g} s"},
                                     status=503)
        if out.finish_reason in ("error", "abort") or not out.token_ids:
            return web.json_response({"status": out.error or "the engine generated nothing"},
                                     status=503)
        return web.json_response({"status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        """Empty the prefix cache of every page no running request holds (they run on, and
        what they hold stays): 200 with the pages freed and left; 503 with the engine
        down. Never refused for load, since nothing running loses a page."""
        if not self.backend.alive:
            raise APIError(503, "the engine is not running", code="engine_unavailable",
                           headers=self._retry())
        try:
            done = await self.backend.flush_cache()
        except EngineError as exc:
            raise APIError(503, str(exc), code="engine_unavailable",
                           headers=self._retry()) from exc
        return web.json_response({"status": "ok", "freed_pages": done.freed_pages,
                                  "held_pages": done.held_pages})


PROTECTED = ("/generate", "/flush_cache", "/health_generate")
"""Paths outside /v1/ that need the API key where one is set (they generate or change)."""


def _outcome(status: int) -> str:
    if status == CLIENT_CLOSED:
        return "cancelled"  # as a client that leaves mid-stream
    return "rejected" if status < 500 or status == 503 else "failed"


def auth_middleware(api_key: str) -> Any:
    """Require ``Authorization: Bearer <api_key>`` on /v1/* and the PROTECTED paths."""
    expected = api_key.encode()

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1/") or request.path in ("/v1", *PROTECTED):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            try:
                given = token.strip().encode()
            except UnicodeEncodeError:  # header bytes that are not UTF-8: not the key
                given = b""
            if scheme.lower() != "bearer" or not hmac.compare_digest(given, expected):
                raise APIError(401, "missing or wrong API key: send the header "
                                    "'Authorization: Bearer <key>'", code="invalid_api_key")
        return await handler(request)

    return auth


async def unready(app: web.Application, delay: float) -> None:
    """Answer /health with 503 for ``delay`` seconds while still serving every request, so
    that a balancer polling /health moves traffic away before the drain."""
    app[STATE].ready = False
    if delay > 0:
        logger.info("shutting down: /health answers 503; still serving for %g s", delay)
        await asyncio.sleep(delay)


async def drain(app: web.Application, timeout: float, grace: float = 10.0) -> bool:
    """Stop admitting, let requests in flight finish for ``timeout`` s, then abort the rest
    (streams end with finish_reason ``abort``, whole responses get 503).

    True if nothing had to be ended.
    """
    state, backend = app[STATE], app[BACKEND]
    state.draining = True
    try:
        await asyncio.wait_for(state.wait_idle(), timeout)
        return True
    except asyncio.TimeoutError:
        logger.warning("%d requests still running after %g s; ending them", state.in_flight,
                       timeout)
    backend.abort_all()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(state.wait_idle(), grace)
    return False
