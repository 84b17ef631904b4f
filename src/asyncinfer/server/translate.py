"""Request translation: a body validated by :mod:`.protocol` becomes token ids and
SamplingParams (a :class:`ParsedRequest`); results become OpenAI's responses and chunks."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from attrs import evolve, field, frozen

import asyncinfer.server.protocol as protocol
import asyncinfer.server.tools as tools
from asyncinfer.errors import InvalidRequestError
from asyncinfer.params import SamplingParams
from asyncinfer.server.errors import APIError, bad_request
from asyncinfer.server.logprobs import LegacyLogprobs, chat_content, joined
from asyncinfer.server.reasoning import ReasoningParser
from asyncinfer.server.tool_parsers import ToolCall, ToolParser

if TYPE_CHECKING:
    from asyncinfer.api import RequestOutput
    from asyncinfer.core import TokenLogprob
    from asyncinfer.outputs import StreamDelta
    from asyncinfer.tokenizer import Tokenizer


class TextEncoder(Protocol):
    """Tokenizes what users send (off the event loop; their text never makes special tokens)."""

    @property
    def renders_tools(self) -> bool: ...   # the chat template lists tools and their calls
    async def encode(self, text: str) -> list[int]: ...
    async def chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                   continue_final_message: bool, template_kwargs: Mapping[str, Any],
                   tools: list[dict[str, Any]] | None = None) -> list[int]: ...


@frozen
class ParsedRequest:
    """A body validated and tokenized: prompt token ids, sampling parameters, how to answer."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    thinking: bool = True  # False: a chat that asked for no reasoning (enable_thinking)
    batch: tuple[list[int], ...] = ()   # every prompt, where the body listed several
    # What echo puts before each prompt's choices: the prompts as sent (text, or token ids
    # to decode), one per prompt; None without echo.
    echo: tuple[str | list[int], ...] | None = None
    tools: ToolParser | None = None   # how a chat's tool calls are read from its output

    @property
    def prompts(self) -> list[list[int]]:
        """The prompts to run: the batch, else the one."""
        return list(self.batch) or [self.prompt_ids]


def check_model(body: Mapping[str, Any], served: str) -> None:
    """``model`` must be omitted or name the served model (else 404 ``model_not_found``)."""
    model = body.get("model")
    if model is None or model == served:
        return
    if not isinstance(model, str):
        raise bad_request(f"model must be a string, got {model!r}", "model")
    raise APIError(404, f"the model {model!r} does not exist; this server serves {served!r}",
                   param="model", code="model_not_found")


async def completion(body: Mapping[str, Any], encoder: TextEncoder,
                     limits: protocol.Limits) -> ParsedRequest:
    """A ``/v1/completions`` body; ``max_tokens`` defaults to SamplingParams' (OpenAI's 16)."""
    req = protocol.validate(protocol.CompletionRequest, body, limits)
    prompts = req.prompts
    batch = [await _prompt_ids(p, encoder, limits, f"prompt[{i}]" if len(prompts) > 1
                               else "prompt") for i, p in enumerate(prompts)]
    options = req.sampling_options()
    if req.logprobs is not None:
        options["logprobs"] = req.logprobs
    if req.echo and (req.logprobs is not None or req.max_tokens == 0):
        # The echoed prompt's logprobs; a pure echo (max_tokens 0) is a scoring request too.
        options["prompt_logprobs"] = req.logprobs or 0
    params = _params(options, req.max_tokens)
    return ParsedRequest(batch[0], params, bool(req.stream), req.include_usage,
                         batch=tuple(batch) if len(batch) > 1 else (),
                         echo=tuple(prompts) if req.echo else None)


async def chat(body: Mapping[str, Any], encoder: TextEncoder,
               limits: protocol.Limits) -> ParsedRequest:
    """A ``/v1/chat/completions`` body; without a length, the server's default applies."""
    req = protocol.validate(protocol.ChatCompletionRequest, body, limits)
    plan = tools.plan(req, limits.tool_call_parser,
                      reasoning=limits.reasoning_parser if req.thinking else None)
    messages, listed = req.chat_messages(), plan.tools
    if not getattr(encoder, "renders_tools", False):   # written in the parser's format
        messages, listed = tools.written(messages, listed, limits.tool_call_parser), []
    ids = await encoder.chat(messages, tools=listed or None, **req.template_options())
    check_length(ids, limits.context_len, "messages")
    max_tokens = getattr(req, req.length_param)
    options = req.sampling_options()
    if plan.structured is not None:
        if "structured" in options:
            raise bad_request(f"tool_choice {req.tool_mode!r} and {options['structured_field']} "
                              f"both constrain the output: set one", "tool_choice")
        options["structured"], options["structured_field"] = plan.structured, "tools"
    if req.logprobs:
        options["logprobs"] = req.top_logprobs or 0
    params = _params(options, limits.default_max_tokens if max_tokens is None else max_tokens)
    return ParsedRequest(ids, params, bool(req.stream), req.include_usage, req.thinking,
                         echo=(req.echoed(),) if req.echo else None, tools=plan.parser)


async def generate(body: Mapping[str, Any], encoder: TextEncoder,
                   limits: protocol.Limits) -> ParsedRequest:
    """The native ``/generate`` body: ``prompt`` or ``input_ids``, ``sampling_params``."""
    req = protocol.validate(protocol.GenerateRequest, body, limits)
    param = "prompt" if req.prompt is not None else "input_ids"
    ids = await _prompt_ids(getattr(req, param), encoder, limits, param)
    options = req.sampling_params or protocol.NativeSampling()
    params = _params(options.sampling_options(), options.max_tokens, "sampling_params.")
    return ParsedRequest(ids, params, bool(req.stream), include_usage=True)


async def _prompt_ids(prompt: str | list[int], encoder: TextEncoder, limits: protocol.Limits,
                      param: str) -> list[int]:
    ids = await encoder.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise bad_request(f"{param} is empty", param)
    check_length(ids, limits.context_len, param)
    return ids


def check_length(ids: list[int], context_len: int, param: str) -> None:
    """Refuse a prompt that leaves no room for an output token, naming both lengths."""
    if len(ids) >= context_len:
        raise bad_request(f"the prompt has {len(ids)} tokens but the context length is "
                          f"{context_len} tokens (prompt and at least one output token must "
                          f"fit)", param, "context_length_exceeded")


def with_tenant(gen: ParsedRequest, tenant: str, param: str) -> ParsedRequest:
    """``gen`` for ``tenant`` (from ``param``, a header), checked as the body's is."""
    try:
        return evolve(gen, params=gen.params.replace(tenant=tenant))
    except InvalidRequestError as exc:
        raise bad_request(str(exc).replace("tenant", param, 1), param) from exc


def _params(options: Mapping[str, Any], max_tokens: int | None,
            prefix: str = "") -> SamplingParams:
    """SamplingParams of fields the request models checked; without ``max_tokens``, its
    default (``prefix``: where the fields sit in the body)."""
    length = {} if max_tokens is None else {"max_tokens": max_tokens}
    params = SamplingParams.prechecked(**options, **length)
    if params.min_tokens > params.max_tokens:
        raise bad_request(f"min_tokens ({params.min_tokens}) must be at most the output "
                          f"length ({params.max_tokens})", f"{prefix}min_tokens")
    return params


def usage(output: RequestOutput) -> dict[str, Any]:
    """OpenAI's usage object of a finished request, with the prompt tokens the prefix cache
    held (``prompt_tokens_details.cached_tokens``): the prompt counted once, every choice's
    tokens."""
    prompt = len(output.prompt_token_ids)
    completion = sum(len(choice.token_ids) for choice in output.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": output.cached_tokens}}


def native_logprobs(entries: Sequence[TokenLogprob | None]) -> list[dict[str, Any] | None]:
    """``/generate``'s logprobs: ``{"token_id", "logprob", "top_logprobs": [[id, lp], ...]}``
    per position (None where there is none: a prompt's first token)."""
    return [None if e is None else {"token_id": e.token, "logprob": e.logprob,
                                    "top_logprobs": [list(pair) for pair in e.top]}
            for e in entries]


@frozen
class Formatter:
    """Builds the response, stream chunks and usage chunk of one completion or chat request;
    with ``parsed`` and ``tokenizer``, its echo and logprobs too."""

    chat: bool
    model: str
    request_id: str
    created: int
    reasoning: ReasoningParser | None = None  # a chat's, with --reasoning-parser
    parsed: ParsedRequest | None = None
    tokenizer: Tokenizer | None = None
    echo_texts: tuple[str, ...] = ()    # what echo puts first, per prompt
    # Each choice's completions logprobs, whose text offsets run on over a stream.
    legacy: dict[int, LegacyLogprobs] = field(factory=dict)

    @classmethod
    def new(cls, chat: bool, model: str, reasoning: ReasoningParser | None = None,
            parsed: ParsedRequest | None = None, tokenizer: Tokenizer | None = None
            ) -> Formatter:
        """A formatter with a fresh request id and the current time."""
        prefix = "chatcmpl" if chat else "cmpl"
        echoed = parsed.echo if parsed is not None else None
        # Token ids are echoed as their text, special tokens spelled out.
        texts = tuple(e if isinstance(e, str) else tokenizer.decode(e, skip_special_tokens=False)
                      if tokenizer is not None else "" for e in echoed or ())
        return cls(chat, model, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), reasoning,
                   parsed, tokenizer, texts)

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.model, "choices": choices}

    def echo_text(self, index: int) -> str:
        """What echo puts before choice ``index``: its prompt's ("" without echo)."""
        if not self.echo_texts:
            return ""
        n = self.parsed.params.n if self.parsed is not None else 1
        return self.echo_texts[min(index // n, len(self.echo_texts) - 1)]

    def response(self, output: RequestOutput) -> dict[str, Any]:
        """The whole (non-streamed) response: a choice per ``output.outputs``."""
        choices = []
        for one in output.outputs:
            choice: dict[str, Any] = {
                "index": one.index, "finish_reason": one.finish_reason,
                "logprobs": self._logprobs(one.index, one.token_ids, one.logprobs,
                                           output.prompt_logprobs, with_prompt=True)}
            if self.chat:
                choice["message"] = message = self.message(one.text, one.index)
                choice["finish_reason"] = finished(one.finish_reason,
                                                   bool(message.get("tool_calls")))
            else:
                choice["text"] = self.echo_text(one.index) + one.text
            choices.append(choice)
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(kind, choices), "usage": usage(output)}

    def chunks(self, delta: StreamDelta, first: bool, include_usage: bool,
               content: str | None = None, reasoning: str = "",
               calls: Sequence[ToolCall] = (), called: int = 0) -> list[Any]:
        """The stream chunks of one delta: its text (after the echo, in its choice's first)
        with its tokens' logprobs, its tool calls, then the usage chunk after the last when
        ``include_usage``; ``content`` and ``reasoning``: the delta's text split by a
        reasoning parser and a tool-call parser; ``calls``: the calls the delta completes,
        after the ``called`` its choice made before. A choice's first delta always makes a
        chunk."""
        index = delta.index
        text = delta.text if content is None else content
        text = self.echo_text(index) + text if first else text
        logprobs = None
        if self._asks_logprobs:
            logprobs = self._logprobs(index, delta.token_ids, delta.logprobs,
                                      delta.prompt_logprobs, with_prompt=first)
        finish = finished(delta.finish_reason, bool(calls or called))
        out = []
        if first or text or reasoning or (finish is not None and not calls) or (
                logprobs is not None and delta.token_ids):
            out.append(self.chunk(text, None if calls else finish, first=first,
                                  include_usage=include_usage, reasoning=reasoning,
                                  index=index, logprobs=logprobs))
        for k, call in enumerate(calls):
            # As OpenAI streams a call: its id and name with empty arguments, then these.
            head = {"index": called + k, "id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": ""}}
            rest = {"index": called + k, "function": {"arguments": call.arguments}}
            out.append(self._call_chunk(head, index, None, include_usage))
            out.append(self._call_chunk(rest, index, finish if k == len(calls) - 1 else None,
                                        include_usage))
        if delta.output is not None and include_usage:
            out.append(self.usage_chunk(delta.output))
        return out

    def message(self, text: str, index: int = 0) -> dict[str, Any]:
        """A chat's whole message, after the echo; with a reasoning parser, the reasoning
        apart; with a tool-call parser, the calls apart (content null if only calls)."""
        echo = self.echo_text(index)
        message: dict[str, Any] = {"role": "assistant", "content": echo + text,
                                   "refusal": None}
        if self.reasoning is not None:
            split = self.reasoning.split(text)
            text = split.content
            message["content"], message["reasoning_content"] = echo + text, split.reasoning
        tools = self.parsed.tools if self.parsed is not None else None
        if tools is not None:
            parsed = tools.parse(text)
            if parsed.calls:
                message["content"] = (echo + (parsed.content or "")) or None
                message["tool_calls"] = [call.openai() for call in parsed.calls]
        return message

    def _call_chunk(self, call: dict[str, Any], index: int, finish_reason: str | None,
                    include_usage: bool) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk", [{
            "index": index, "delta": {"tool_calls": [call]}, "logprobs": None,
            "finish_reason": finish_reason}])
        if include_usage:
            body["usage"] = None
        return body

    def chunk(self, text: str, finish_reason: str | None, *, first: bool = False,
              include_usage: bool = False, reasoning: str = "", index: int = 0,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """One stream chunk of choice ``index``; a chat's first chunk of each choice also
        carries the assistant role; ``reasoning``: the delta's reasoning text (``text`` its
        content)."""
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs,
                                  "finish_reason": finish_reason}
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else (
                {"content": text} if text else {})
            if reasoning:
                delta["reasoning_content"] = reasoning
                if not text:
                    delta.pop("content", None)
            choice["delta"] = delta
        else:
            choice["text"] = text
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion",
                              [choice])
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, output: RequestOutput) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(kind, []), "usage": usage(output)}

    @property
    def _asks_logprobs(self) -> bool:
        return (self.parsed is not None and self.tokenizer is not None
                and self.parsed.params.logprobs is not None)

    def _logprobs(self, index: int, token_ids: Sequence[int],
                  entries: Sequence[TokenLogprob] | None,
                  prompt: Sequence[TokenLogprob | None] | None, with_prompt: bool
                  ) -> dict[str, Any] | None:
        """Choice ``index``'s ``logprobs`` for ``token_ids`` (None if the request asks for
        none); ``with_prompt``: the echoed prompt's tokens first (completions, one prompt)."""
        parsed, tokenizer = self.parsed, self.tokenizer
        if parsed is None or tokenizer is None or parsed.params.logprobs is None:
            return None
        top, entries = parsed.params.logprobs, entries or []
        if self.chat:
            return {"content": chat_content(entries, top, tokenizer)}
        legacy = self.legacy.get(index)
        if legacy is None:
            legacy = self.legacy[index] = LegacyLogprobs(top, tokenizer)
        parts = []
        if with_prompt and parsed.echo is not None:
            ids = parsed.prompt_ids
            parts.append(legacy.add(ids, prompt if prompt is not None else [None] * len(ids),
                                    self._unwritten(ids, parsed.echo[0])))
        skipped = tokenizer.special_ids if parsed.params.skip_special_tokens else ()
        parts.append(legacy.add(token_ids, entries, skipped))
        return joined(*parts)

    def _unwritten(self, ids: Sequence[int], echo: str | list[int]) -> set[int]:
        """The prompt's special tokens its echoed text does not spell (a BOS the tokenizer
        added): they take no room in the text offsets."""
        assert self.tokenizer is not None
        if not isinstance(echo, str):
            return set()
        special = self.tokenizer.special_ids
        return {t for t in set(ids) & special if self.tokenizer.piece(t)[0] not in echo}


def finished(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason of a chat choice: ``tool_calls`` where one that made calls
    stopped by itself."""
    return "tool_calls" if called and reason == "stop" else reason


def merge(outputs: list[RequestOutput], n: int) -> RequestOutput:
    """The outputs of a list of prompts as one: choices prompt-major (prompt i's choice j is
    ``i * n + j``), prompt and cached tokens summed (one usage), timed as the first."""
    prompt_ids = [t for o in outputs for t in o.prompt_token_ids]
    choices = [evolve(c, index=i * n + c.index) for i, o in enumerate(outputs)
               for c in o.outputs]
    return evolve(outputs[0], prompt_token_ids=prompt_ids, outputs=choices,
                  cached_tokens=sum(o.cached_tokens for o in outputs))
