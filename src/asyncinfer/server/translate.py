"""Request translation: a body validated by :mod:`.protocol` becomes token ids and
SamplingParams (a :class:`ParsedRequest`); results become OpenAI's responses and chunks."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from attrs import evolve, frozen

import asyncinfer.server.protocol as protocol
from asyncinfer.errors import InvalidRequestError
from asyncinfer.params import SamplingParams
from asyncinfer.server.errors import APIError, bad_request
from asyncinfer.server.logprobs import LegacyLogprobs, chat_content, joined
from asyncinfer.server.reasoning import ReasoningParser

if TYPE_CHECKING:
    from asyncinfer.api import RequestOutput
    from asyncinfer.core import TokenLogprob
    from asyncinfer.outputs import StreamDelta
    from asyncinfer.tokenizer import Tokenizer


class TextEncoder(Protocol):
    """Tokenizes what users send (off the event loop; their text never makes special tokens)."""

    async def encode(self, text: str) -> list[int]: ...
    async def chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool,
                   continue_final_message: bool,
                   template_kwargs: Mapping[str, Any]) -> list[int]: ...


@frozen
class ParsedRequest:
    """A body validated and tokenized: prompt token ids, sampling parameters, how to answer."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    thinking: bool = True  # False: a chat that asked for no reasoning (enable_thinking)
    # What echo puts before the output: the prompt as sent (text, or token ids to decode);
    # None without echo.
    echo: str | list[int] | None = None


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
    ids = await _prompt_ids(req.prompt, encoder, limits, "prompt")
    options = req.sampling_options()
    if req.logprobs is not None:
        options["logprobs"] = req.logprobs
    if req.echo and (req.logprobs is not None or req.max_tokens == 0):
        # The echoed prompt's logprobs; a pure echo (max_tokens 0) is a scoring request too.
        options["prompt_logprobs"] = req.logprobs or 0
    params = _params(options, req.max_tokens)
    return ParsedRequest(ids, params, bool(req.stream), req.include_usage,
                         echo=req.prompt if req.echo else None)


async def chat(body: Mapping[str, Any], encoder: TextEncoder,
               limits: protocol.Limits) -> ParsedRequest:
    """A ``/v1/chat/completions`` body; without a length, the server's default applies."""
    req = protocol.validate(protocol.ChatCompletionRequest, body, limits)
    ids = await encoder.chat(req.chat_messages(), **req.template_options())
    check_length(ids, limits.context_len, "messages")
    max_tokens = getattr(req, req.length_param)
    options = req.sampling_options()
    if req.logprobs:
        options["logprobs"] = req.top_logprobs or 0
    params = _params(options, limits.default_max_tokens if max_tokens is None else max_tokens)
    return ParsedRequest(ids, params, bool(req.stream), req.include_usage, req.thinking,
                         echo=req.echoed() if req.echo else None)


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
    held (``prompt_tokens_details.cached_tokens``)."""
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
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
    # The completions logprobs of the choice, whose text offsets run on over a stream.
    legacy: LegacyLogprobs | None = None
    echo_text: str = ""     # what echo puts first

    @classmethod
    def new(cls, chat: bool, model: str, reasoning: ReasoningParser | None = None,
            parsed: ParsedRequest | None = None, tokenizer: Tokenizer | None = None
            ) -> Formatter:
        """A formatter with a fresh request id and the current time."""
        prefix = "chatcmpl" if chat else "cmpl"
        top = parsed.params.logprobs if parsed is not None else None
        legacy = (LegacyLogprobs(top, tokenizer) if top is not None and not chat
                  and tokenizer is not None else None)
        echo = parsed.echo if parsed is not None else None
        if isinstance(echo, list):  # token ids: their text, special tokens spelled out
            echo = tokenizer.decode(echo, skip_special_tokens=False) if tokenizer else ""
        return cls(chat, model, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), reasoning,
                   parsed, tokenizer, legacy, echo or "")

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.model, "choices": choices}

    def response(self, output: RequestOutput) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        text = self.echo_text + output.text
        choice: dict[str, Any] = {
            "index": 0, "logprobs": self._logprobs(output, with_prompt=True),
            "finish_reason": output.finish_reason}
        if self.chat:
            choice["message"] = self.message(output.text)
        else:
            choice["text"] = text
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(kind, [choice]), "usage": usage(output)}

    def chunks(self, delta: StreamDelta, first: bool, include_usage: bool,
               content: str | None = None, reasoning: str = "") -> list[Any]:
        """The stream chunks of one delta: its text (after the echo, in the first) with its
        tokens' logprobs, then the usage chunk after the last when ``include_usage``;
        ``content`` and ``reasoning``: the delta's text split by a reasoning parser."""
        text = delta.text if content is None else content
        text = self.echo_text + text if first else text
        logprobs = self._logprobs(delta, with_prompt=first)
        out = []
        if first or text or reasoning or delta.finish_reason is not None or (
                logprobs is not None and delta.token_ids):
            out.append(self.chunk(text, delta.finish_reason, first=first,
                                  include_usage=include_usage, reasoning=reasoning,
                                  logprobs=logprobs))
        if delta.output is not None and include_usage:
            out.append(self.usage_chunk(delta.output))
        return out

    def message(self, text: str) -> dict[str, Any]:
        """A chat's whole message, after the echo; with a reasoning parser, the reasoning
        apart."""
        if self.reasoning is None:
            return {"role": "assistant", "content": self.echo_text + text, "refusal": None}
        split = self.reasoning.split(text)
        return {"role": "assistant", "content": self.echo_text + split.content,
                "reasoning_content": split.reasoning, "refusal": None}

    def chunk(self, text: str, finish_reason: str | None, *, first: bool = False,
              include_usage: bool = False, reasoning: str = "",
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """One stream chunk; a chat's first chunk also carries the assistant role;
        ``reasoning``: the delta's reasoning text (``text`` its content)."""
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs,
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

    def _logprobs(self, part: RequestOutput | StreamDelta, with_prompt: bool
                  ) -> dict[str, Any] | None:
        """The choice's ``logprobs`` for the tokens of ``part`` (None if the request asks
        for none); ``with_prompt``: the echoed prompt's tokens first (completions)."""
        parsed, tokenizer = self.parsed, self.tokenizer
        if parsed is None or tokenizer is None or parsed.params.logprobs is None:
            return None
        token_ids: Sequence[int] = part.token_ids
        entries: Sequence[TokenLogprob] = part.logprobs or []
        prompt = part.prompt_logprobs
        if self.chat:
            return {"content": chat_content(entries, parsed.params.logprobs, tokenizer)}
        assert self.legacy is not None
        parts = []
        if with_prompt and parsed.echo is not None:
            ids = parsed.prompt_ids
            parts.append(self.legacy.add(
                ids, prompt if prompt is not None else [None] * len(ids),
                self._unwritten(ids, parsed.echo)))
        skipped = tokenizer.special_ids if parsed.params.skip_special_tokens else ()
        parts.append(self.legacy.add(token_ids, entries, skipped))
        return joined(*parts)

    def _unwritten(self, ids: Sequence[int], echo: str | list[int]) -> set[int]:
        """The prompt's special tokens its echoed text does not spell (a BOS the tokenizer
        added): they take no room in the text offsets."""
        assert self.tokenizer is not None
        if not isinstance(echo, str):
            return set()
        special = self.tokenizer.special_ids
        return {t for t in set(ids) & special if self.tokenizer.piece(t)[0] not in echo}
