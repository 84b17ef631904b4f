"""The aiohttp application: OpenAI-compatible routes, the native ``/generate``, health, metrics.

Handlers read the body (within ``body_timeout``), validate it (:mod:`.protocol`), tokenize
off the event loop, then await the engine; a streamed request is relayed delta by delta.
Headers go out with the first delta, so a request the engine refuses at once (its first delta
is an error) still gets a plain error status. A client that goes away aborts its request: the
handler task is cancelled (``handler_cancellation``) or the next write fails, and either way
the engine's iterator is closed.

Admission: past ``max_waiting_requests`` queued requests, or while the server drains, a
generation request gets 503 with ``Retry-After``. :func:`drain` is the graceful shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from attrs import define, frozen

import asyncinfer.server.openai as openai
import asyncinfer.server.protocol as protocol
from asyncinfer.errors import ConfigError, EngineError
from asyncinfer.server.errors import (
    APIError,
    bad_request,
    error_middleware,
    error_payload,
    http_status,
)
from asyncinfer.server.metrics import CONTENT_TYPE, ServerMetrics
from asyncinfer.server.options import ServerOptions

if TYPE_CHECKING:
    from asyncinfer.api import RequestOutput
    from asyncinfer.params import SamplingParams
    from asyncinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 2**20


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
    @property
    def alive(self) -> bool: ...
    def abort_all(self) -> None: ...


ENGINE = web.AppKey("engine", Engine)


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


class _Encoder:
    """The tokenizer behind a thread pool: a long prompt never stalls the event loop (the
    Rust tokenizer releases the GIL while it works)."""

    def __init__(self, tokenizer: Tokenizer, special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.special_tokens = special_tokens
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="asyncinfer-tokenize")

    async def encode(self, text: str) -> list[int]:
        return await self._run(functools.partial(
            self.tokenizer.encode, text, special_tokens=self.special_tokens))

    async def chat(self, messages: list[dict[str, str]]) -> list[int]:
        return await self._run(functools.partial(
            self.tokenizer.apply_chat_template, messages, special_tokens=self.special_tokens))

    async def _run(self, work: Callable[[], list[int]]) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self.pool, work)


# The header a gateway names the tenant in; it takes precedence over a body's ``user``.
TENANT_HEADER = "X-Tenant"

Parse = Callable[[dict[str, Any], openai.TextEncoder, protocol.Limits],
                 Awaitable[openai.GenerationRequest]]


class _Routes:
    """The request handlers of one app, sharing its engine, model name, limits and metrics."""

    def __init__(self, engine: Engine, served_model_name: str, metrics: ServerMetrics,
                 options: ServerOptions, state: ServerState, worker: WorkerInfo) -> None:
        if engine.tokenizer is None:
            raise ConfigError("the server needs the model's tokenizer "
                              "(the engine was built with skip_tokenizer_init=True)")
        self.engine = engine
        self.encoder = _Encoder(engine.tokenizer, options.special_tokens_in_text)
        self.served_name = served_model_name
        self.metrics = metrics
        self.options = options
        self.state = state
        self.worker = worker
        context = engine.context_len
        self.limits = protocol.Limits(
            vocab_size=engine.tokenizer.vocab_size, context_len=context,
            max_prompt_chars=protocol.max_prompt_chars(context, engine.tokenizer.max_token_chars),
            max_tokens_limit=min(options.max_tokens_limit or context, context),
            default_max_tokens=options.default_max_tokens)

    def counted(self, handler: CallHandler) -> Handler:
        """``handler`` as an aiohttp handler that admits the request, tracks it while in
        flight, and counts it once, by outcome."""

        async def run(request: web.Request) -> web.StreamResponse:
            call = _Call(request)
            self.state.enter()
            try:
                self._admit()
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

    def _admit(self) -> None:
        retry = {"Retry-After": str(self.options.retry_after)}
        if self.state.draining:
            raise APIError(503, "the server is shutting down", code="server_shutting_down",
                           headers=retry)
        if not self.engine.alive:
            raise APIError(503, "the engine is not running", code="engine_unavailable",
                           headers=retry)
        waiting = self.engine.stats().waiting + self.state.admitting
        if waiting >= self.options.max_waiting_requests:
            raise APIError(503, f"the server is full: {waiting} requests are waiting (the "
                                f"limit is {self.options.max_waiting_requests}); retry later",
                           code="server_overloaded", headers=retry)

    async def _parse(self, call: _Call, parse: Parse) -> openai.GenerationRequest:
        """Read, validate and tokenize the body; counted as waiting while it happens."""
        self.state.admitting += 1
        try:
            body = await _json_body(call.request, self.options.body_timeout)
            gen = await parse(body, self.encoder, self.limits)
            tenant = call.request.headers.get(TENANT_HEADER)
            if tenant is not None:  # a gateway's word over the body's ``user``
                gen = openai.with_tenant(gen, tenant, TENANT_HEADER)
        finally:
            self.state.admitting -= 1
        if self.state.draining:  # the drain began while the body arrived or was tokenized
            raise APIError(503, "the server is shutting down", code="server_shutting_down",
                           headers={"Retry-After": str(self.options.retry_after)})
        return gen

    async def completions(self, call: _Call) -> web.StreamResponse:
        gen = await self._parse(call, self._openai_parser(openai.completion))
        return await self._openai(call, gen, openai.Formatter.new(False, self.served_name))

    async def chat(self, call: _Call) -> web.StreamResponse:
        gen = await self._parse(call, self._openai_parser(openai.chat))
        return await self._openai(call, gen, openai.Formatter.new(True, self.served_name))

    def _openai_parser(self, parse: Parse) -> Parse:
        async def checked(body: dict[str, Any], encoder: openai.TextEncoder,
                          limits: protocol.Limits) -> openai.GenerationRequest:
            openai.check_model(body, self.served_name)
            return await parse(body, encoder, limits)

        return checked

    async def generate(self, call: _Call) -> web.StreamResponse:
        gen = await self._parse(call, openai.generate)

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
        failure = self._failure(output)
        if failure is not None:
            raise failure
        return output

    def _failure(self, output: RequestOutput) -> APIError | None:
        """The error a finished request is answered with, if it did not succeed: the engine
        refusing it is the client's (400), the engine failing it is ours (500), and a request
        ended by the shutdown, or by the engine going away, is 503."""
        if output.finish_reason == "abort" and self.state.draining:
            return APIError(503, "the server shut down before the request finished",
                            code="server_shutting_down")
        if output.finish_reason != "error":
            return None
        message = output.error or "the engine failed the request"
        kind = getattr(output, "error_kind", None)
        if kind == "unavailable":
            return APIError(503, message, code="engine_unavailable")
        if kind == "engine":
            return APIError(500, message, code="engine_error")
        return bad_request(message)

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
                failure = None
                if output is not None:
                    self._finished(call, output)
                    failure = self._failure(output) if output.finish_reason == "error" else None
                first = response is None
                if response is None:
                    if failure is not None:
                        raise failure
                    response = web.StreamResponse(headers={
                        "Content-Type": framing.content_type, "Cache-Control": "no-cache",
                        "X-Accel-Buffering": "no"})
                    await response.prepare(call.request)
                frames = [error_payload(failure)[1]] if failure else render(delta, first)
                for obj in frames:
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
            # Routine (and counted in /metrics): not a line at the default log level.
            logger.debug("client went away during %s; request aborted", call.request.path)
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
        """200 while the engine loop runs and the server accepts work; 503 otherwise (and
        from the start of a shutdown, while requests are still served)."""
        if self.state.draining:
            return web.json_response({"status": "draining"}, status=503)
        if not self.state.ready:
            return web.json_response({"status": "shutting down"}, status=503)
        if not self.engine.alive:
            return web.json_response({"status": "engine stopped"}, status=503)
        return web.json_response({"status": "ok"})

    async def server_info(self, request: web.Request) -> web.Response:
        """What a router registering this server reads (sglang-router's worker protocol):
        the served model, parallelism, limits, and the live counters."""
        stats = self.engine.stats()
        return web.json_response({
            **self.worker.server_info(), "served_model_name": self.served_name,
            "context_length": self.engine.context_len,
            "max_waiting_requests": self.options.max_waiting_requests,
            "num_running_reqs": stats.running, "num_waiting_reqs": stats.waiting,
            "kv_pages_used": stats.kv_pages_used, "kv_pages_total": stats.kv_pages_total,
            "version": _version()})

    async def model_info(self, request: web.Request) -> web.Response:
        """The model, as a router registering this server reads it."""
        return web.json_response({**self.worker.model_info(),
                                  "served_model_name": self.served_name,
                                  "is_generation": True,
                                  "context_length": self.engine.context_len})

    async def load(self, request: web.Request) -> web.Response:
        """The load a router's load-aware policies weigh (sglang-router's power_of_two sums
        ``num_tokens``): one entry per data-parallel rank, here one. Tokens are those whose
        KV the running requests hold."""
        stats = self.engine.stats()
        return web.json_response([{
            "dp_rank": 0, "num_reqs": stats.running + stats.waiting,
            "num_running_reqs": stats.running, "num_waiting_reqs": stats.waiting,
            "num_tokens": stats.kv_pages_used * self.worker.page_size}])

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(protocol.openapi_document(self.limits, self.served_name))


_STARTED = int(time.time())


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("asyncinfer")
    except PackageNotFoundError:
        return "unknown"


@frozen
class WorkerInfo:
    """The model a server runs, as routers and operators ask for it: where it was loaded
    from, its architecture, and the parallelism it runs with."""

    model_path: str | None = None
    model_type: str | None = None
    architectures: tuple[str, ...] = ()
    tp_size: int = 1
    policy: str | None = None
    page_size: int = 16
    device: str | None = None
    dtype: str | None = None

    @classmethod
    def from_model_dir(cls, model_dir: str, tp_size: int = 1, policy: str | None = None,
                       page_size: int = 16, *, device: str | None = None,
                       dtype: str | None = None) -> WorkerInfo:
        """Read from the model directory's config.json (what is missing stays None)."""
        try:
            config = json.loads((Path(model_dir) / "config.json").read_text())
        except (OSError, ValueError):
            config = {}
        return cls(model_dir, config.get("model_type"),
                   tuple(config.get("architectures") or ()), tp_size, policy, page_size,
                   device, dtype)

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path,
                "model_type": self.model_type, "architectures": list(self.architectures)}

    def server_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path,
                "tp_size": self.tp_size, "dp_size": 1, "policy": self.policy,
                "page_size": self.page_size, "device": self.device, "dtype": self.dtype,
                "engine": "asyncinfer"}


async def _json_body(request: web.Request, timeout: float) -> dict[str, Any]:
    """The parsed body; 408 if it does not arrive within ``timeout`` seconds, 400 if it is
    not JSON or holds text that is not valid Unicode (a lone surrogate escape)."""
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                       code="request_timeout", headers={"Connection": "close"}) from None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # also bad UTF-8 and absurd nesting
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got "
                          f"{type(body).__name__}")
    _check_unicode(body)
    return body


def _check_unicode(body: dict[str, Any]) -> None:
    """Refuse strings that cannot be encoded (lone UTF-16 surrogates, which JSON's ``\\ud800``
    escapes can spell), naming the first field that holds one. The field's path is built only
    for the refusal: a deep body costs one pass over it, nothing more."""
    where = _bad_text(body)
    if where is not None:
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in where).lstrip(".")
        raise bad_request(f"{param or 'the body'} is not valid Unicode (it holds a lone "
                          "surrogate)", param or None)


def _bad_text(value: Any) -> list[str | int] | None:
    """The path to the first string in ``value`` that cannot be encoded, or None."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode()
        except UnicodeEncodeError:
            return []
        return None
    items = value.items() if isinstance(value, dict) else (
        enumerate(value) if isinstance(value, list) else ())
    for key, item in items:
        if isinstance(key, str) and _bad_text(key) is not None:
            return [key]
        inner = _bad_text(item)
        if inner is not None:
            return [key, *inner]
    return None


async def _close(deltas: AsyncIterator[Any]) -> None:
    """Close the engine's iterator; an unfinished request is aborted by it."""
    aclose = getattr(deltas, "aclose", None)
    if aclose is not None:
        await aclose()


def _outcome(status: int) -> str:
    return "rejected" if status < 500 or status == 503 else "failed"


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
               served_model_name: str | None = None,
               options: ServerOptions | None = None,
               worker: WorkerInfo | None = None) -> web.Application:
    """An app serving ``engine``; the caller starts and closes the engine.

    With ``api_key`` set, /v1/* and /generate need ``Authorization: Bearer <api_key>``;
    /health, /metrics, /openapi.json and the router's worker routes (/server_info,
    /model_info, /get_load and their older spellings) stay open. ``served_model_name``
    defaults to ``engine.model_name``; ``worker`` describes the model to routers.
    """
    options = options or ServerOptions()
    metrics = ServerMetrics(engine.stats)
    middlewares = [error_middleware] + ([_auth_middleware(api_key)] if api_key else [])
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    state = ServerState()
    app[METRICS], app[STATE], app[ENGINE] = metrics, state, engine
    routes = _Routes(engine, served_model_name or engine.model_name, metrics, options, state,
                     worker or WorkerInfo())
    app.router.add_post("/v1/completions", routes.counted(routes.completions))
    app.router.add_post("/v1/chat/completions", routes.counted(routes.chat))
    app.router.add_post("/generate", routes.counted(routes.generate))
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/v1/models/{model}", routes.model)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/metrics", routes.prometheus)
    app.router.add_get("/openapi.json", routes.openapi)
    # sglang-router's worker protocol (the older spellings for older routers).
    for path, handler in (("/server_info", routes.server_info),
                          ("/get_server_info", routes.server_info),
                          ("/model_info", routes.model_info),
                          ("/get_model_info", routes.model_info),
                          ("/get_load", routes.load)):
        app.router.add_get(path, handler)

    async def stop_tokenizing(app: web.Application) -> None:
        routes.encoder.pool.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(stop_tokenizing)
    return app


async def unready(app: web.Application, delay: float) -> None:
    """Answer /health with 503 for ``delay`` seconds while still serving every request: a
    load balancer or router that polls /health takes this server out before it refuses
    work (then ``drain``)."""
    app[STATE].ready = False
    if delay > 0:
        logger.info("shutting down: /health answers 503; still serving for %g s", delay)
        await asyncio.sleep(delay)


async def drain(app: web.Application, timeout: float, grace: float = 10.0) -> bool:
    """Stop admitting (``/health`` answers 503), let the requests in flight finish for up to
    ``timeout`` seconds, then end the rest: streams get a last chunk with finish_reason
    ``abort`` and their end marker, whole responses a 503. True if nothing had to be ended."""
    state, engine = app[STATE], app[ENGINE]
    state.draining = True
    try:
        await asyncio.wait_for(state.wait_idle(), timeout)
        return True
    except asyncio.TimeoutError:
        logger.warning("%d requests still running after %g s; ending them", state.in_flight,
                       timeout)
    engine.abort_all()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(state.wait_idle(), grace)
    return False
