"""The request bodies of the HTTP API as strict typed models; a body that fails is a 400
naming the field, before any tokenizing. See docs/architecture.md, "Request models"."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any

from attrs import frozen
from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from asyncinfer.params import MAX_LOGPROBS, MAX_TENANT_CHARS
from asyncinfer.server.chat_template import ChatTemplateFields
from asyncinfer.server.errors import APIError, bad_request, from_validation
from asyncinfer.server.fields import (
    MAX_CHOICES,
    BestOf,
    Choices,
    EchoMaxTokens,
    Integral,
    MaxTokens,
    MinP,
    Seed,
    Stop,
    Temperature,
    TopK,
    TopLogprobs,
    TopP,
    bounded,
    check_stop,
    integral,
)
from asyncinfer.server.fields import Strict as _Strict
from asyncinfer.server.messages import ChatMessage
from asyncinfer.server.structured import constraint
from asyncinfer.server.token_fields import (
    LogitBias,
    StopTokenIds,
    check_logit_bias,
    check_stop_token_ids,
)
from asyncinfer.server.tools import ToolFields

ROLES = ("system", "developer", "user", "assistant", "tool")


@frozen
class Limits:
    """What the served model and options allow (the validation context); past
    ``max_prompt_chars`` a text cannot fit the context, so it is refused untokenized."""

    vocab_size: int
    context_len: int
    max_prompt_chars: int
    max_tokens_limit: int
    default_max_tokens: int
    tool_call_parser: str | None = None   # --tool-call-parser: tools may be called
    reasoning_parser: str | None = None   # --reasoning-parser: a block may come first


def _limits(info: ValidationInfo) -> Limits:
    limits = (info.context or {}).get("limits")
    assert isinstance(limits, Limits), "validate bodies through protocol.validate"
    return limits


def _check_top_k(value: int | None, info: ValidationInfo) -> int | None:
    vocab = _limits(info).vocab_size
    if value is not None and value > vocab:
        raise ValueError(f"must be -1, 0 (off) or at most the vocabulary size {vocab}")
    return value


def _check_max_tokens(value: int | None, info: ValidationInfo) -> int | None:
    limit = _limits(info).max_tokens_limit
    if value is not None and value > limit:
        raise ValueError(f"must be at most {limit} (this server's limit)")
    return value


class StreamOptions(_Strict):
    """OpenAI's ``stream_options``."""

    include_usage: bool | None = None


_SAMPLING_OPTIONS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos",
                     "skip_special_tokens", "priority", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                     "stop_token_ids")
# vLLM's extension: lower runs first where the engine's policy orders by it.
_Priority = Annotated[Annotated[int, bounded("priority"), Integral] | None,
                      Field(description="lower runs first (with the priority policy)")]


# Whom the request is for: fair-share policies (vtc) share the engine between tenants.
_Tenant = Annotated[str | None, Field(max_length=MAX_TENANT_CHARS,
                                      description="the tenant, for fair-share policies")]


class _Sampling(_Strict):
    """The sampling fields every generation route takes, with their ranges."""

    temperature: Temperature = None
    top_p: TopP = None
    top_k: TopK = None
    min_p: MinP = None
    seed: Seed = None
    stop: Stop = None
    ignore_eos: bool | None = None
    priority: _Priority = None
    # OpenAI's penalties and bias, and vLLM's extensions.
    presence_penalty: Annotated[float, bounded("presence_penalty")] | None = None
    frequency_penalty: Annotated[float, bounded("frequency_penalty")] | None = None
    repetition_penalty: Annotated[float, bounded("repetition_penalty")] | None = None
    logit_bias: LogitBias = None
    min_tokens: Annotated[int, bounded("min_tokens", upper=False), Integral] | None = None
    stop_token_ids: StopTokenIds = None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: Any, info: ValidationInfo) -> Any:
        return check_logit_bias(value, _limits(info).vocab_size)

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, value: Any, info: ValidationInfo) -> Any:
        return check_stop_token_ids(value, _limits(info).vocab_size)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        return check_stop(value)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None, info: ValidationInfo) -> int | None:
        return _check_top_k(value, info)

    def sampling_options(self) -> dict[str, Any]:
        """The SamplingParams keyword options the body sets (``max_tokens`` aside)."""
        return {name: value for name in _SAMPLING_OPTIONS
                if (value := getattr(self, name, None)) is not None}


class _OpenAISampling(_Sampling):
    """The fields completions and chat share: sampling, framing, and refused extras."""

    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Choices = None
    best_of: BestOf = None
    user: _Tenant = None
    # Not implemented: refused unless unset or at their default (see _refuse_unsupported).
    suffix: str | None = None
    # What constrains the output (server/structured.py checks them, whatever their type);
    # left out of the OpenAPI document, whose fuzzing cannot draw texts that compile.
    response_format: SkipJsonSchema[dict[str, Any] | None] = None
    structured_outputs: SkipJsonSchema[dict[str, Any] | None] = None
    guided_json: SkipJsonSchema[Any] = None
    guided_regex: SkipJsonSchema[Any] = None
    guided_choice: SkipJsonSchema[Any] = None
    guided_grammar: SkipJsonSchema[Any] = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _OpenAISampling:
        for name, unset in UNSUPPORTED.items():
            if getattr(self, name) not in unset:
                allowed = " or ".join(json.dumps(v) for v in unset if v is not None)
                raise APIError(400, f"{name} is not supported by this server: leave it unset "
                                    f"or {allowed}", param=name)
        constraint(self)
        n = self.n or 1
        if self.best_of is not None and self.best_of < n:
            raise bad_request(f"best_of must be at least n ({n}), got {self.best_of}",
                              "best_of")
        if self.best_of is not None and self.best_of > n and self.stream:
            raise bad_request(f"best_of above n ({n}) cannot be streamed: the best choices "
                              "are known only at the end", "best_of")
        return self

    @property
    def choices(self) -> int:
        """Sequences sampled per prompt (``best_of``, else ``n``)."""
        return self.best_of or self.n or 1

    def sampling_options(self) -> dict[str, Any]:
        """The SamplingParams keyword options the body sets, ``user`` as the tenant."""
        options = super().sampling_options()
        if self.user is not None:
            options["tenant"] = self.user
        if self.n is not None:
            options["n"] = self.n
        if self.best_of is not None:
            options["best_of"] = self.best_of
        if (constrained := constraint(self)) is not None:
            options["structured"], options["structured_field"] = constrained
        return options

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


# Each refused field with the values that ask for nothing beyond plain generation.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {"suffix": (None, "")}

_PromptSchema = WithJsonSchema({"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
    {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES,
     "items": {"type": "string", "minLength": 1}},
    {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES,
     "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}},
]})


class CompletionRequest(_OpenAISampling):
    """``POST /v1/completions``: a prompt (text or token ids) or a list of them; ``max_tokens``
    defaults to 16. A list of several is ``prompts``; ``prompt`` is then the list.
    ``logprobs: k``: each token's logprob and its k most probable alternatives; ``echo``: the
    prompt first, with its tokens' logprobs when ``logprobs`` is set."""

    prompt: Annotated[Any, _PromptSchema] = Field(
        description=f"a string or token ids, or a list of them (prompts x best_of or n at "
                    f"most {MAX_CHOICES})")
    max_tokens: EchoMaxTokens = None
    echo: bool | None = None
    logprobs: TopLogprobs = None
    top_logprobs: Annotated[Any, WithJsonSchema({"type": "null"})] = None

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        return _check_max_tokens(value, info)

    @model_validator(mode="after")
    def _completion_fields(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens: 0 asks for no output, which only echo (scoring "
                                "the prompt) allows; set echo: true or max_tokens of at "
                                "least 1", param="max_tokens")
        if self.echo and self.logprobs is not None and (
                len(self.prompts) > 1 or self.choices > 1):
            raise APIError(400, "echo with logprobs scores one prompt: it takes neither a list "
                                "of prompts nor n or best_of above 1", param="echo")
        if self.top_logprobs is not None:
            raise APIError(400, "top_logprobs is a chat field; completions take logprobs: k "
                                f"(0 to {MAX_LOGPROBS} alternatives per token)",
                           param="top_logprobs")
        return self

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]
        elif isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) > MAX_CHOICES:
                raise bad_request(f"prompt may list at most {MAX_CHOICES} prompts, got "
                                  f"{len(value)}", "prompt")
            return [check_prompt(p, _limits(info), f"prompt[{i}]") for i, p in enumerate(value)]
        return check_prompt(value, _limits(info), "prompt")

    @model_validator(mode="after")
    def _choices_capped(self) -> CompletionRequest:
        if len(self.prompts) * self.choices > MAX_CHOICES:
            raise bad_request(f"prompt lists {len(self.prompts)} prompts of {self.choices} "
                              f"choices each; at most {MAX_CHOICES} choices in all", "prompt")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """Every prompt of the body: one, or the list given."""
        value = self.prompt
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            return list(value)
        return [value]


class ChatCompletionRequest(_OpenAISampling, ChatTemplateFields, ToolFields):
    """``POST /v1/chat/completions``; without a length the server's default applies."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: MaxTokens = None
    max_completion_tokens: MaxTokens = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs = None
    echo: bool | None = Field(default=None, description="the last message's content first, "
                                                          "if the assistant's (as vLLM's)")

    @model_validator(mode="after")
    def _logprobs_fields(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return self

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        return _check_max_tokens(value, info)

    @model_validator(mode="after")
    def _fits_by_characters(self, info: ValidationInfo) -> ChatCompletionRequest:
        limits = _limits(info)
        chars = (sum(m.characters() for m in self.messages) + self.template_chars()
                 + (len(json.dumps(self.tool_list())) if self.tools else 0))
        if chars > limits.max_prompt_chars:
            raise too_long_by_characters(chars, limits, "messages")
        return self

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as chat templates take them (see ``ChatMessage.rendered``)."""
        return [m.rendered(i) for i, m in enumerate(self.messages)]

    def echoed(self) -> str:
        """What ``echo`` puts before the reply: the last message's text if the assistant's
        (a turn the reply continues), else nothing."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    @property
    def length_param(self) -> str:
        """The length field the body uses (``max_completion_tokens`` wins)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else (
            "max_tokens")


_Logprobs = Annotated[Annotated[int, Field(ge=0, le=MAX_LOGPROBS), Integral] | None,
                      Field(description=f"top alternatives per position, 0 to {MAX_LOGPROBS}")]
# max_tokens 0 scores the prompt and samples nothing: only with prompt_logprobs.
_ScoringMaxTokens = Annotated[int, Field(ge=0), Integral] | None


class NativeSampling(_Sampling):
    """``sampling_params`` of ``/generate``: SamplingParams' own fields; others are refused."""

    model_config = ConfigDict(strict=True, extra="forbid")

    max_tokens: _ScoringMaxTokens = None
    skip_special_tokens: bool | None = None
    tenant: _Tenant = None
    logprobs: _Logprobs = None
    prompt_logprobs: _Logprobs = None

    def sampling_options(self) -> dict[str, Any]:
        """The SamplingParams keyword options the body sets (``max_tokens`` aside)."""
        options = super().sampling_options()
        if self.tenant is not None:
            options["tenant"] = self.tenant
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        return options

    @model_validator(mode="after")
    def _scoring(self) -> NativeSampling:
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise bad_request("sampling_params.max_tokens may be 0 only with prompt_logprobs "
                              "(a request that scores its prompt and samples nothing)",
                              "sampling_params.max_tokens")
        return self

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value: int | None, info: ValidationInfo) -> int | None:
        return _check_max_tokens(value, info)


class GenerateRequest(_Strict):
    """``POST /generate``: ``prompt`` (text) or ``input_ids``, ``sampling_params``, ``stream``."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={
        "oneOf": [{"required": ["prompt"]}, {"required": ["input_ids"]}]})

    prompt: Annotated[str | None, WithJsonSchema({"type": "string", "minLength": 1})] = None
    input_ids: Annotated[Any, WithJsonSchema(
        {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}})] = None
    sampling_params: NativeSampling | None = None
    stream: bool | None = None

    @model_validator(mode="after")
    def _one_prompt(self, info: ValidationInfo) -> GenerateRequest:
        if (self.prompt is None) == (self.input_ids is None):
            raise APIError(400, "give exactly one of prompt (a string) and input_ids (token "
                                "ids)", param="prompt")
        if self.prompt is not None:
            check_prompt(self.prompt, _limits(info), "prompt")
        elif not isinstance(self.input_ids, list):
            raise bad_request("input_ids must be a list of token ids", "input_ids")
        else:
            check_prompt(self.input_ids, _limits(info), "input_ids")
        return self


def check_prompt(value: Any, limits: Limits, param: str) -> str | list[int]:
    """A text prompt within the character bound, or token ids within the vocabulary and the
    context; cheap checks first, so an oversized prompt costs no more than its length."""
    if isinstance(value, str):
        if not value:
            raise bad_request(f"{param} is empty", param)
        if len(value) > limits.max_prompt_chars:
            raise too_long_by_characters(len(value), limits, param)
        return value
    if not isinstance(value, list) or not value:
        raise bad_request(f"{param} must be a non-empty string or a non-empty list of token "
                          "ids", param)
    if len(value) >= limits.context_len:
        raise bad_request(f"the prompt has {len(value)} tokens but the context length is "
                          f"{limits.context_len} tokens (prompt and at least one output token "
                          "must fit)", param, "context_length_exceeded")
    vocab = limits.vocab_size
    value = [integral(t) for t in value]
    bad = next((t for t in value if not (_is_int(t) and 0 <= t < vocab)), None)
    if bad is not None:
        raise bad_request(f"{param} has token id {bad!r} outside the vocabulary [0, {vocab})",
                          param)
    return value


def too_long_by_characters(chars: int, limits: Limits, param: str) -> APIError:
    """The refusal of a text that cannot fit the context by its characters alone."""
    return bad_request(f"the prompt has {chars} characters; no more than "
                       f"{limits.max_prompt_chars} can fit the context length of "
                       f"{limits.context_len} tokens", param, "context_length_exceeded")


def validate(model: type[_Strict], body: Any, limits: Limits) -> Any:
    """``body`` (parsed JSON) as ``model``; a 400 naming the first field at fault otherwise."""
    if not isinstance(body, Mapping):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body, context={"limits": limits})
    except ValidationError as exc:
        raise from_validation(exc) from None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)

