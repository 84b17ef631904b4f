"""Request bodies in, validated generation requests out; responses and chunks in OpenAI's shapes.

Parsing never trusts a field's type: every value a user can get wrong becomes a 400 that
names the field (``param``), before anything reaches the engine.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from attrs import fields, frozen

from asyncinfer.errors import InvalidRequestError
from asyncinfer.params import SamplingParams
from asyncinfer.server.errors import APIError, bad_request
from asyncinfer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from asyncinfer.api import RequestOutput

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed")
_NATIVE_FIELDS = frozenset(f.name for f in fields(SamplingParams))
# OpenAI fields that would change the output but are not implemented: refused unless unset.
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "echo": lambda v: v in (None, False),
    "best_of": lambda v: v in (None, 1),
    "logprobs": lambda v: v in (None, False),
    "top_logprobs": lambda v: v in (None, 0),
    "logit_bias": lambda v: not v,
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "suffix": lambda v: v in (None, ""),
    "tools": lambda v: not v,
    "response_format": lambda v: v is None or v == {"type": "text"},
}


@frozen
class GenerationRequest:
    """A validated request: prompt token ids, sampling parameters and how to answer."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False


def check_model(body: Mapping[str, Any], served: str) -> None:
    """``model`` must be omitted or name the served model (else 404 ``model_not_found``)."""
    model = body.get("model")
    if model is None or model == served:
        return
    if not isinstance(model, str):
        raise bad_request(f"model must be a string, got {model!r}", "model")
    raise APIError(404, f"the model {model!r} does not exist; this server serves {served!r}",
                   param="model", code="model_not_found")


def parse_completion(body: Mapping[str, Any], tokenizer: Tokenizer,
                     context_len: int) -> GenerationRequest:
    """A ``/v1/completions`` body; ``max_tokens`` defaults to 16 as in OpenAI's API."""
    _check_common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not _is_token_list(prompt):
        if len(prompt) != 1:
            raise bad_request(f"prompt must be one string or one list of token ids; "
                              f"batches are not supported (got a list of {len(prompt)})",
                              "prompt")
        prompt = prompt[0]
    ids = prompt_ids(prompt, tokenizer, "prompt")
    max_tokens = _optional(body, "max_tokens")
    params = sampling_params(body, _SAMPLING_FIELDS, max_tokens=16 if max_tokens is None
                             else max_tokens, max_tokens_param="max_tokens")
    return _request(body, ids, params, context_len, "prompt")


def parse_chat(body: Mapping[str, Any], tokenizer: Tokenizer,
               context_len: int) -> GenerationRequest:
    """A ``/v1/chat/completions`` body; without a token limit the reply may fill the context."""
    _check_common(body)
    ids = tokenizer.apply_chat_template(chat_messages(body.get("messages")))
    check_length(ids, context_len, "messages")
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else (
        "max_tokens")
    max_tokens = _optional(body, param)
    params = sampling_params(body, _SAMPLING_FIELDS, max_tokens=context_len - len(ids)
                             if max_tokens is None else max_tokens, max_tokens_param=param)
    return _request(body, ids, params, context_len, "messages")


def parse_generate(body: Mapping[str, Any], tokenizer: Tokenizer,
                   context_len: int) -> GenerationRequest:
    """The native ``/generate`` body: ``prompt`` or ``input_ids``, ``sampling_params``."""
    if ("prompt" in body) == ("input_ids" in body):
        raise bad_request("give exactly one of prompt (a string) and input_ids (token ids)",
                          "prompt")
    param = "prompt" if "prompt" in body else "input_ids"
    value = body[param]
    if param == "prompt" and not isinstance(value, str):
        raise bad_request(f"prompt must be a string, got {_kind(value)}", "prompt")
    if param == "input_ids" and not isinstance(value, list):
        raise bad_request(f"input_ids must be a list of token ids, got {_kind(value)}",
                          "input_ids")
    ids = prompt_ids(value, tokenizer, param)
    options = {} if body.get("sampling_params") is None else body["sampling_params"]
    if not isinstance(options, dict):
        raise bad_request(f"sampling_params must be an object, got {_kind(options)}",
                          "sampling_params")
    unknown = sorted(set(options) - _NATIVE_FIELDS)
    if unknown:
        raise bad_request(f"unknown sampling parameter(s) {', '.join(unknown)}; known: "
                          f"{', '.join(sorted(_NATIVE_FIELDS))}", f"sampling_params.{unknown[0]}")
    for flag in ("ignore_eos", "skip_special_tokens"):
        _check_bool(options, flag, "sampling_params.")
    _check_stop(options.get("stop"), "sampling_params.stop")
    params = _build(options, "sampling_params.")
    return _request(body, ids, params, context_len, param, include_usage=True)


def prompt_ids(prompt: Any, tokenizer: Tokenizer, param: str) -> list[int]:
    """Token ids of a text prompt or a list of token ids, validated against the vocabulary."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        vocab = tokenizer.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"{param} has token id {bad[0]} outside the vocabulary "
                              f"[0, {vocab})", param)
        ids = list(prompt)
    elif prompt is None:
        raise bad_request(f"{param} is required", param)
    else:
        raise bad_request(f"{param} must be a string or a list of token ids, got "
                          f"{_kind(prompt)}", param)
    if not ids:
        raise bad_request(f"{param} is empty", param)
    return ids


def check_length(ids: list[int], context_len: int, param: str) -> None:
    """Refuse a prompt that leaves no room for an output token, naming both lengths."""
    if len(ids) >= context_len:
        raise bad_request(f"the prompt has {len(ids)} tokens but the context length is "
                          f"{context_len} tokens (prompt and at least one output token must "
                          f"fit)", param, "context_length_exceeded")


def chat_messages(messages: Any) -> list[dict[str, str]]:
    """OpenAI chat messages as ``{"role", "content"}`` strings; text parts are joined."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects",
                          "messages")
    result = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"{where} must be an object with a string role", where)
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise bad_request(f"{where}.content: only text parts are supported",
                                  f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad_request(f"{where}.content must be a string or a list of text parts",
                              f"{where}.content")
        role = "system" if message["role"] == "developer" else message["role"]
        result.append({"role": role, "content": content})
    return result


def sampling_params(body: Mapping[str, Any], names: tuple[str, ...], *, max_tokens: Any,
                    max_tokens_param: str) -> SamplingParams:
    """SamplingParams from OpenAI fields; ``null`` means the default."""
    _check_bool(body, "ignore_eos")
    _check_stop(body.get("stop"), "stop")
    options = {name: body[name] for name in (*names, "stop", "ignore_eos")
               if body.get(name) is not None}
    return _build({**options, "max_tokens": max_tokens}, "",
                  {"max_tokens": max_tokens_param})


def _build(options: Mapping[str, Any], prefix: str,
           rename: Mapping[str, str] | None = None) -> SamplingParams:
    try:
        return SamplingParams(**options)
    except InvalidRequestError as exc:
        # SamplingParams' messages start with the field's name.
        name = str(exc).split(" ", 1)[0]
        param = (rename or {}).get(name, name)
        raise bad_request(str(exc).replace(name, param, 1), prefix + param
                          if name in _NATIVE_FIELDS else None) from exc


def _check_common(body: Mapping[str, Any]) -> None:
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad_request(f"n must be 1: this server returns one choice per request, got "
                          f"{n!r}", "n")
    for name, is_unset in _UNSUPPORTED.items():
        if not is_unset(body.get(name)):
            raise bad_request(f"{name} is not supported by this server", name)


def _request(body: Mapping[str, Any], ids: list[int], params: SamplingParams,
             context_len: int, param: str, include_usage: bool = False) -> GenerationRequest:
    check_length(ids, context_len, param)
    _check_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request(f"stream_options must be an object, got {_kind(options)}",
                              "stream_options")
        _check_bool(options, "include_usage", "stream_options.")
        include_usage = bool(options.get("include_usage"))
    return GenerationRequest(ids, params, bool(body.get("stream")), include_usage)


def _optional(body: Mapping[str, Any], name: str) -> Any:
    value = body.get(name)
    if value is not None and not _is_int(value):
        raise bad_request(f"{name} must be an integer >= 1, got {value!r}", name)
    return value


def _check_bool(body: Mapping[str, Any], name: str, prefix: str = "") -> None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"{prefix}{name} must be true or false, got {value!r}",
                          prefix + name)


def _check_stop(stop: Any, param: str) -> None:
    if stop is None or isinstance(stop, str):
        return
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad_request(f"{param} must be a string or a list of strings, got {stop!r}", param)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_token_list(value: list[Any]) -> bool:
    return bool(value) and all(_is_int(t) for t in value)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def usage(output: RequestOutput) -> dict[str, int]:
    """OpenAI's usage object of a finished request."""
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


@frozen
class Formatter:
    """Builds the response, stream chunks and usage chunk of one completion or chat request."""

    chat: bool
    model: str
    request_id: str
    created: int

    @classmethod
    def new(cls, chat: bool, model: str) -> Formatter:
        """A formatter with a fresh request id and the current time."""
        prefix = "chatcmpl" if chat else "cmpl"
        return cls(chat, model, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.model, "choices": choices}

    def response(self, output: RequestOutput) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None,
                                  "finish_reason": output.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": output.text}
        else:
            choice["text"] = output.text
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(kind, [choice]), "usage": usage(output)}

    def chunk(self, text: str, finish_reason: str | None, *, first: bool = False,
              include_usage: bool = False) -> dict[str, Any]:
        """One stream chunk; a chat's first chunk also carries the assistant role."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else (
                {"content": text} if text else {})
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
