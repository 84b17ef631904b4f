"""The aiohttp application: OpenAI-compatible routes, the native ``/generate``, health, metrics.

Handlers validate and tokenize, then await the engine; a streamed request is relayed delta by
delta. Headers go out with the first delta, so a request the engine refuses at once (its
first delta is an error) still gets a plain 400. A client that goes away aborts its request:
the handler task is cancelled (``handler_cancellation``) or the next write fails, and either
way the engine's iterator is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from attrs import define, frozen

from asyncinfer.errors import ConfigError, EngineError
from asyncinfer.server import openai
from asyncinfer.server.errors import (
    APIError,
    bad_request,
    error_body,
    error_middleware,
    error_payload,
    http_status,
)
from asyncinfer.server.metrics import CONTENT_TYPE, ServerMetrics

if TYPE_CHECKING:
    from asyncinfer.api import RequestOutput
    from asyncinfer.params import SamplingParams
    from asyncinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 2**20
METRICS = web.AppKey("metrics", ServerMetrics)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class StreamDelta(Protocol):
    """What ``Engine.stream`` yields: new text and tokens; the last one carries the output."""

    @property
    def text(self) -> str: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def output(self) -> RequestOutput | None: ...


class Engine(Protocol):
    """The part of ``AsyncEngine`` the server uses."""

    @property
    def model_name(self) -> str: ...
    @property
    def tokenizer(self) -> Tokenizer | None: ...
    @property
    def context_len(self) -> int: ...
    async def generate(self, prompt: str | list[int],
                       params: SamplingParams | None = None) -> RequestOutput: ...
    def stream(self, prompt: str | list[int],
               params: SamplingParams | None = None) -> AsyncIterator[StreamDelta]: ...
    def stats(self) -> Any: ...


@frozen
class _Framing:
    """How a stream is framed: Server-Sent Events for OpenAI routes, NDJSON for /generate."""

    content_type: str
    prefix: bytes
    suffix: bytes
    done: bytes

    def frame(self, obj: Any) -> bytes:
        return self.prefix + json.dumps(obj, ensure_ascii=False).encode() + self.suffix


SSE = _Framing("text/event-stream", b"data: ", b"\n\n", b"data: [DONE]\n\n")
NDJSON = _Framing("application/x-ndjson", b"", b"\n", b"")
Render = Callable[[StreamDelta, bool], list[Any]]


@define
class _Call:
    """One generation request in flight: the HTTP request and how it ended (metrics.OUTCOMES)."""

    request: web.Request
    outcome: str | None = None


CallHandler = Callable[[_Call], Awaitable[web.StreamResponse]]


class _Routes:
    """The request handlers of one app, sharing its engine, model name and metrics."""

    def __init__(self, engine: Engine, served_model_name: str, metrics: ServerMetrics) -> None:
        if engine.tokenizer is None:
            raise ConfigError("the server needs the model's tokenizer "
                              "(the engine was built with skip_tokenizer_init=True)")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_name = served_model_name
        self.metrics = metrics

    def counted(self, handler: CallHandler) -> Handler:
        """``handler`` as an aiohttp handler that counts each request once, by outcome."""

        async def run(request: web.Request) -> web.StreamResponse:
            call = _Call(request)
            try:
                response = await handler(call)
            except asyncio.CancelledError:
                self.metrics.record_outcome(call.outcome or "cancelled")
                raise
            except Exception as exc:
                # "error" is the engine refusing the request; otherwise the status tells.
                refused = call.outcome == "error"
                self.metrics.record_outcome("error" if refused else _outcome(http_status(exc)))
                raise
            self.metrics.record_outcome(call.outcome or "failed")
            return response

        return run

    async def completions(self, call: _Call) -> web.StreamResponse:
        body = await _json_body(call.request)
        openai.check_model(body, self.served_name)
        gen = openai.parse_completion(body, self.tokenizer, self.engine.context_len)
        return await self._openai(call, gen, openai.Formatter.new(False, self.served_name))

    async def chat(self, call: _Call) -> web.StreamResponse:
        body = await _json_body(call.request)
        openai.check_model(body, self.served_name)
        gen = openai.parse_chat(body, self.tokenizer, self.engine.context_len)
        return await self._openai(call, gen, openai.Formatter.new(True, self.served_name))

    async def generate(self, call: _Call) -> web.StreamResponse:
        body = await _json_body(call.request)
        gen = openai.parse_generate(body, self.tokenizer, self.engine.context_len)

        def lines(delta: StreamDelta, first: bool) -> list[Any]:
            line: dict[str, Any] = {"text": delta.text, "token_ids": list(delta.token_ids),
                                    "finish_reason": delta.finish_reason}
            if delta.output is not None:
                line["usage"] = openai.usage(delta.output)
            return [line]

        if gen.stream:
            return await self._relay(call, gen, NDJSON, lines)
        output = await self._run(call, gen)
        return web.json_response({"text": output.text, "token_ids": list(output.token_ids),
                                  "finish_reason": output.finish_reason,
                                  "usage": openai.usage(output)})

    async def _openai(self, call: _Call, gen: openai.GenerationRequest,
                      fmt: openai.Formatter) -> web.StreamResponse:
        if not gen.stream:
            return web.json_response(fmt.response(await self._run(call, gen)))

        def chunks(delta: StreamDelta, first: bool) -> list[Any]:
            out = []
            if first or delta.text or delta.finish_reason is not None:
                out.append(fmt.chunk(delta.text, delta.finish_reason, first=first,
                                     include_usage=gen.include_usage))
            if delta.output is not None and gen.include_usage:
                out.append(fmt.usage_chunk(delta.output))
            return out

        return await self._relay(call, gen, SSE, chunks)

    async def _run(self, call: _Call, gen: openai.GenerationRequest) -> RequestOutput:
        output = await self.engine.generate(gen.prompt_ids, gen.params)
        self._finished(call, output)
        if output.finish_reason == "error":
            raise bad_request(output.error or "the engine refused the request")
        return output

    def _finished(self, call: _Call, output: RequestOutput) -> None:
        call.outcome = output.finish_reason
        self.metrics.observe(output)

    async def _relay(self, call: _Call, gen: openai.GenerationRequest, framing: _Framing,
                     render: Render) -> web.StreamResponse:
        deltas = self.engine.stream(gen.prompt_ids, gen.params)
        response: web.StreamResponse | None = None
        try:
            async for delta in deltas:
                output = delta.output
                if output is not None:
                    self._finished(call, output)
                failed = output is not None and output.finish_reason == "error"
                message = (output.error if output is not None else None) or "request failed"
                first = response is None
                if response is None:
                    if failed:
                        raise bad_request(message)
                    response = web.StreamResponse(headers={
                        "Content-Type": framing.content_type, "Cache-Control": "no-cache",
                        "X-Accel-Buffering": "no"})
                    await response.prepare(call.request)
                for obj in [error_body(400, message)] if failed else render(delta, first):
                    await response.write(framing.frame(obj))
                if output is not None:
                    break
            if response is None:
                raise EngineError("the engine ended the stream without a result")
            await response.write(framing.done)
            await response.write_eof()
        except ConnectionResetError:
            if response is None:
                raise
            call.outcome = call.outcome or "cancelled"
            logger.info("client went away during %s; request aborted", call.request.path)
        except Exception as exc:
            if response is None:
                raise
            # Headers are out: the error can only travel as the stream's last frame.
            call.outcome = "failed"
            with contextlib.suppress(ConnectionResetError):
                await response.write(framing.frame(error_payload(exc, call.request)[1])
                                     + framing.done)
                await response.write_eof()
        finally:
            await _close(deltas)
        return response

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        openai.check_model({"model": request.match_info["model"]}, self.served_name)
        return web.json_response(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.served_name, "object": "model", "created": _STARTED,
                "owned_by": "asyncinfer", "max_model_len": self.engine.context_len}

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


_STARTED = int(time.time())


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, RecursionError) as exc:  # also bad UTF-8 and absurd nesting
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got "
                          f"{type(body).__name__}")
    return body


async def _close(deltas: AsyncIterator[Any]) -> None:
    """Close the engine's iterator; an unfinished request is aborted by it."""
    aclose = getattr(deltas, "aclose", None)
    if aclose is not None:
        await aclose()


def _outcome(status: int) -> str:
    return "rejected" if status < 500 else "failed"


def _auth_middleware(api_key: str) -> Any:
    expected = api_key.encode()

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1/") or request.path in ("/v1", "/generate"):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    token.strip().encode(), expected):
                raise APIError(401, "missing or wrong API key: send the header "
                                    "'Authorization: Bearer <key>'", code="invalid_api_key")
        return await handler(request)

    return auth


def create_app(engine: Engine, *, api_key: str | None = None,
               served_model_name: str | None = None) -> web.Application:
    """An app serving ``engine``; the caller starts and closes the engine.

    With ``api_key`` set, /v1/* and /generate need ``Authorization: Bearer <api_key>``;
    /health and /metrics stay open. ``served_model_name`` defaults to ``engine.model_name``.
    """
    metrics = ServerMetrics(engine.stats)
    middlewares = [error_middleware] + ([_auth_middleware(api_key)] if api_key else [])
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[METRICS] = metrics
    routes = _Routes(engine, served_model_name or engine.model_name, metrics)
    app.router.add_post("/v1/completions", routes.counted(routes.completions))
    app.router.add_post("/v1/chat/completions", routes.counted(routes.chat))
    app.router.add_post("/generate", routes.counted(routes.generate))
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/v1/models/{model}", routes.model)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/metrics", routes.prometheus)
    return app
