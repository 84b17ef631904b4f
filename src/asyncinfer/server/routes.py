"""The request handlers: OpenAI's completions, chat and models, the native ``/generate``,
``/metrics`` and ``/openapi.json``.

A generation handler reads the body (within ``body_timeout``), validates and tokenizes it
(:mod:`.translate`), then awaits the backend; a stream is relayed delta by delta, its headers
sent with the first delta, so that a request the engine refuses at once gets a plain error
status. A client that goes away closes the backend's iterator, which aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from aiohttp import web
from attrs import evolve, frozen

import asyncinfer.server.protocol as protocol
import asyncinfer.server.reasoning as reasoning
import asyncinfer.server.translate as translate
from asyncinfer.errors import ConfigError, EngineError
from asyncinfer.outputs import Merged
from asyncinfer.server.backend import GenerateBackend
from asyncinfer.server.body import decoded
from asyncinfer.server.errors import CLIENT_CLOSED, APIError, bad_request, error_payload
from asyncinfer.server.metrics import CONTENT_TYPE, ServerMetrics
from asyncinfer.server.openapi import openapi_document
from asyncinfer.server.operations import Call, Operations
from asyncinfer.server.options import ServerOptions
from asyncinfer.server.tool_parsers import ToolStream

if TYPE_CHECKING:
    from asyncinfer.outputs import RequestOutput, StreamDelta
    from asyncinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# The header a gateway names the tenant in; it takes precedence over a body's ``user``.
TENANT_HEADER = "X-Tenant"
_STARTED = int(time.time())

Parse = Callable[[dict[str, Any], translate.TextEncoder, protocol.Limits],
                 Awaitable[translate.ParsedRequest]]


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
Render = Callable[["StreamDelta", bool], list[Any]]


class _Encoder:
    """The tokenizer behind a thread pool, so that a long prompt never stalls the event loop
    (the Rust tokenizer releases the GIL)."""

    def __init__(self, tokenizer: Tokenizer, special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.special_tokens = special_tokens
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="asyncinfer-tokenize")

    async def encode(self, text: str) -> list[int]:
        return await self._run(functools.partial(
            self.tokenizer.encode, text, special_tokens=self.special_tokens))

    @property
    def renders_tools(self) -> bool:
        return bool(getattr(self.tokenizer, "renders_tools", False))

    async def chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                   continue_final_message: bool, template_kwargs: Mapping[str, Any],
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
        return await self._run(functools.partial(
            self.tokenizer.apply_chat_template, messages, special_tokens=self.special_tokens,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, template_kwargs=template_kwargs,
            **({"tools": tools} if tools else {})))

    async def _run(self, work: Callable[[], list[int]]) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self.pool, work)


class Routes:
    """The handlers of one app, sharing its backend, served name, limits and metrics."""

    def __init__(self, backend: GenerateBackend, served_name: str, metrics: ServerMetrics,
                 options: ServerOptions, operations: Operations) -> None:
        tokenizer = backend.tokenizer
        if tokenizer is None:
            raise ConfigError("the server needs the model's tokenizer "
                              "(the engine was built with skip_tokenizer_init=True)")
        self.backend = backend
        self.encoder = _Encoder(tokenizer, options.special_tokens_in_text)
        self.served_name = served_name
        self.metrics = metrics
        self.options = options
        self.operations = operations
        context = backend.context_len
        self.limits = protocol.Limits(
            vocab_size=tokenizer.vocab_size, context_len=context,
            max_prompt_chars=max_prompt_chars(context, tokenizer.max_token_chars),
            max_tokens_limit=min(options.max_tokens_limit or context, context),
            default_max_tokens=options.default_max_tokens,
            tool_call_parser=options.tool_call_parser,
            reasoning_parser=options.reasoning_parser)

    def add_routes(self, app: web.Application) -> None:
        counted = self.operations.counted
        app.router.add_post("/v1/completions", counted(self.completions))
        app.router.add_post("/v1/chat/completions", counted(self.chat))
        app.router.add_post("/generate", counted(self.generate))
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/openapi.json", self.openapi)

    async def _parse(self, call: Call, parse: Parse) -> translate.ParsedRequest:
        """Read the body, then validate and tokenize it, counted as waiting from the moment
        it has arrived (an upload that stalls holds no place in the queue)."""
        body = await read_json_body(call.request, self.options.body_timeout)
        self.operations.admit()  # the queue may have filled while the body arrived
        with self.operations.admitting():
            parsed = await parse(body, self.encoder, self.limits)
            tenant = call.request.headers.get(TENANT_HEADER)
            if tenant is not None:  # a gateway's word over the body's ``user``
                parsed = translate.with_tenant(parsed, tenant, TENANT_HEADER)
        return parsed

    async def completions(self, call: Call) -> web.StreamResponse:
        parsed = await self._parse(call, self._checking_model(translate.completion))
        return await self._openai(call, parsed, translate.Formatter.new(
            False, self.served_name, None, parsed, self.encoder.tokenizer))

    async def chat(self, call: Call) -> web.StreamResponse:
        parsed = await self._parse(call, self._checking_model(translate.chat))
        parser = self.options.reasoning_parser
        split = None if parser is None else reasoning.parser(parser, thinking=parsed.thinking)
        return await self._openai(call, parsed, translate.Formatter.new(
            True, self.served_name, split, parsed, self.encoder.tokenizer))

    def _checking_model(self, parse: Parse) -> Parse:
        async def checked(body: dict[str, Any], encoder: translate.TextEncoder,
                          limits: protocol.Limits) -> translate.ParsedRequest:
            translate.check_model(body, self.served_name)
            return await parse(body, encoder, limits)

        return checked

    async def generate(self, call: Call) -> web.StreamResponse:
        parsed = await self._parse(call, translate.generate)

        asks, scores = parsed.params.logprobs is not None, parsed.params.prompt_logprobs

        def lines(delta: StreamDelta, first: bool) -> list[Any]:
            line: dict[str, Any] = {"text": delta.text, "token_ids": list(delta.token_ids),
                                    "finish_reason": delta.finish_reason}
            if asks:
                line["logprobs"] = translate.native_logprobs(delta.logprobs or [])
            prompt = getattr(delta, "prompt_logprobs", None)  # a backend's own delta may lack it
            if prompt is not None:
                line["prompt_logprobs"] = translate.native_logprobs(prompt)
            if delta.output is not None:
                line["usage"] = translate.usage(delta.output)
            return [line]

        if parsed.stream:
            return await self._relay(call, parsed, NDJSON, lines)
        output = await self._run(call, parsed)
        body = {"text": output.text, "token_ids": list(output.token_ids),
                "finish_reason": output.finish_reason, "usage": translate.usage(output)}
        if asks:
            body["logprobs"] = translate.native_logprobs(output.logprobs or [])
        if scores is not None:
            body["prompt_logprobs"] = translate.native_logprobs(output.prompt_logprobs or [])
        return web.json_response(body)

    async def _openai(self, call: Call, parsed: translate.ParsedRequest,
                      fmt: translate.Formatter) -> web.StreamResponse:
        if not parsed.stream:
            return web.json_response(fmt.response(await self._run_all(call, parsed)))
        started: set[int] = set()  # the choices whose first chunk (a chat's role) went out

        splits: dict[int, reasoning.ReasoningStream] = {}  # by choice
        calls: dict[int, ToolStream] = {}

        def chunks(delta: StreamDelta, first: bool) -> list[Any]:
            first = delta.index not in started
            text, thought, done = delta.text, "", delta.finish_reason is not None
            if fmt.reasoning is not None:
                split = splits.get(delta.index)
                if split is None:
                    split = splits[delta.index] = fmt.reasoning.stream()
                thought, text = split.push(delta.text)
                if done:
                    more_thought, more_text = split.finish()
                    thought, text = thought + more_thought, text + more_text
            started.add(delta.index)  # a choice's first delta always makes a chunk
            if parsed.tools is None:
                return fmt.chunks(delta, first, parsed.include_usage, text, thought)
            stream = calls.get(delta.index)
            if stream is None:
                stream = calls[delta.index] = parsed.tools.stream()
            before = len(stream.calls)
            text, made = stream.push(text)
            if done:
                more_text, more_made = stream.finish()
                text, made = text + more_text, made + more_made
            return fmt.chunks(delta, first, parsed.include_usage, text, thought, made, before)

        return await self._relay(call, parsed, SSE, chunks)

    async def _run_all(self, call: Call, parsed: translate.ParsedRequest) -> RequestOutput:
        """Every prompt of the request at once, as one output (the first failure raised)."""
        if not parsed.batch:
            return await self._run(call, parsed)
        runs = [asyncio.ensure_future(self._run(call, evolve(parsed, prompt_ids=ids)))
                for ids in parsed.batch]
        try:
            outputs = await asyncio.gather(*runs)
        finally:
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
        return translate.merge(list(outputs), parsed.params.n)

    def _stream_all(self, parsed: translate.ParsedRequest) -> AsyncIterator[StreamDelta]:
        if not parsed.batch:
            return self.backend.stream(parsed.prompt_ids, parsed.params)
        return self._merged(parsed)

    async def _merged(self, parsed: translate.ParsedRequest) -> AsyncIterator[StreamDelta]:
        """The streams of a list of prompts as one: choice indexes prompt-major, the last
        delta carrying the merged output (or the first failed prompt's)."""
        n, merged = parsed.params.n, Merged["StreamDelta"]()
        finals: dict[int, RequestOutput] = {}
        try:
            for ids in parsed.batch:
                merged.add(self.backend.stream(ids, parsed.params))
            while True:
                i, delta = await merged.next()
                output = delta.output
                if output is not None and output.finish_reason != "error":
                    finals[i] = output
                    output = (translate.merge([finals[k] for k in sorted(finals)], n)
                              if len(finals) == len(parsed.batch) else None)
                yield evolve(delta, index=i * n + delta.index, output=output)
                if delta.output is not None and output is not None:
                    return
        finally:
            await merged.close()

    async def _run(self, call: Call, parsed: translate.ParsedRequest) -> RequestOutput:
        output = await self.backend.generate(parsed.prompt_ids, parsed.params)
        self._finished(call, output)
        failure = self._failure(output)
        if failure is not None:
            raise failure
        return output

    def _failure(self, output: RequestOutput) -> APIError | None:
        """The error a request that did not succeed is answered with: refused by the engine
        400, failed by it 500, ended by the shutdown or an engine gone 503."""
        if output.finish_reason == "abort" and self.operations.state.draining:
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

    def _finished(self, call: Call, output: RequestOutput) -> None:
        call.outcome = output.finish_reason
        self.metrics.observe(output)

    async def _relay(self, call: Call, parsed: translate.ParsedRequest, framing: _Framing,
                     render: Render) -> web.StreamResponse:
        deltas = self._stream_all(parsed)
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
        translate.check_model({"model": request.match_info["model"]}, self.served_name)
        return web.json_response(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.served_name, "object": "model", "created": _STARTED,
                "owned_by": "asyncinfer", "max_model_len": self.backend.context_len}

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document(self.limits, self.served_name))


async def read_json_body(request: web.Request, timeout: float) -> dict[str, Any]:
    """The parsed body: 408 if it does not arrive within ``timeout`` s, 400 if it is not a
    JSON object or holds text that is not valid Unicode."""
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                       code="request_timeout", headers={"Connection": "close"}) from None
    except ConnectionError:  # the client hung up mid-body: nobody to answer, nothing wrong
        logger.debug("the client of %s %s left before its body arrived", request.method,
                     request.path)
        raise APIError(CLIENT_CLOSED, "the client closed the connection",
                       code="client_closed_request") from None
    except web.RequestPayloadError as exc:  # a short chunked body
        raise bad_request(f"the request body could not be read: {exc}") from None
    raw = await decoded(request, raw, request.client_max_size)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # also bad UTF-8 and absurd nesting
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got "
                          f"{type(body).__name__}")
    check_unicode(body)
    return body


def check_unicode(body: dict[str, Any]) -> None:
    """Refuse a string holding a lone UTF-16 surrogate (JSON's ``\\ud800`` can spell one),
    naming the first field that does; the path is built only for the refusal."""
    where = bad_text(body)
    if where is not None:
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in where).lstrip(".")
        raise bad_request(f"{param or 'the body'} is not valid Unicode (it holds a lone "
                          "surrogate)", param or None)


def bad_text(value: Any) -> list[str | int] | None:
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
        if isinstance(key, str) and bad_text(key) is not None:
            return [key]
        inner = bad_text(item)
        if inner is not None:
            return [key, *inner]
    return None


async def _close(deltas: AsyncIterator[Any]) -> None:
    """Close the backend's iterator; an unfinished request is aborted by it."""
    aclose = getattr(deltas, "aclose", None)
    if aclose is not None:
        await aclose()


def max_prompt_chars(context_len: int, max_token_chars: int) -> int:
    """The most characters a text of ``context_len`` tokens can have."""
    return context_len * max(1, max_token_chars)
