"""The typed fields the HTTP request models share: sampling ranges from ``params.BOUNDS``
as pydantic constraints, with the JSON schemas the OpenAPI document publishes."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

from asyncinfer.params import BOUNDS, MAX_LOGPROBS, MAX_N, MIN_TEMPERATURE

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024


class Strict(BaseModel):
    """Strict types, extra fields ignored (OpenAI clients send fields this server needs not)."""

    model_config = ConfigDict(strict=True, extra="ignore")


def integral(value: Any) -> Any:
    """JSON's ``2.0`` is an integer to JSON Schema: take it as 2 (``2.5`` stays refused)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def bounded(name: str, *, upper: bool = True) -> Any:
    """The constraints of ``params.BOUNDS[name]``; ``upper=False`` where a served limit is
    tighter (top_k, max_tokens)."""
    bound = BOUNDS[name]
    limits: dict[str, Any] = {"gt" if bound.open_low else "ge": bound.low}
    if upper:
        limits["le"] = bound.high
    if not bound.integer:
        limits["allow_inf_nan"] = False
    return Field(**limits)


Integral = BeforeValidator(integral)
Temperature = Annotated[Annotated[float, bounded("temperature")] | None,
                         Field(description=f"0 is greedy; a temperature below "
                                           f"{MIN_TEMPERATURE} is greedy too")]
TopP = Annotated[float, bounded("top_p")] | None
TopK = Annotated[Annotated[int, bounded("top_k", upper=False), Integral] | None,
                  Field(description="-1 or 0: off; else at most the vocabulary size")]
MinP = Annotated[float, bounded("min_p")] | None
Seed = Annotated[Annotated[int, bounded("seed"), Integral] | None,
                  Field(description="any integer of 64 bits")]
MaxTokens = Annotated[int, bounded("max_tokens", upper=False), Integral] | None
# Completions' max_tokens may be 0 with echo: the prompt scored, nothing generated. The
# schema says 1 and up, what every body may send; the description names the exception.
EchoMaxTokens = Annotated[Annotated[int, Field(ge=0), Integral] | None, WithJsonSchema({
    "anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}],
    "description": "at least 1; 0 only with echo (scoring the prompt)"})]
TopLogprobs = Annotated[Annotated[int, Field(ge=0, le=MAX_LOGPROBS), Integral] | None,
                         Field(description=f"alternatives per token, 0 to {MAX_LOGPROBS}")]
Choices = Annotated[Annotated[int, bounded("n"), Integral] | None,
               Field(description=f"choices returned, at most {MAX_N}")]
BestOf = Annotated[Annotated[int, Field(ge=1, le=MAX_N), Integral] | None,
                    Field(description="choices sampled (at least n); the n most likely "
                                      "are returned")]
# Choices of one /v1/completions request, over all its prompts (prompts x best_of or n):
# what one body may put into the engine at once.
MAX_CHOICES = 128
Stop = Annotated[Any, WithJsonSchema({
    "anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
              {"type": "array", "maxItems": MAX_STOP_STRINGS,
               "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}},
              {"type": "null"}]})]


def check_stop(value: Any) -> Any:
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise ValueError("must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    if not all(0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise ValueError(f"every stop string must have 1 to {MAX_STOP_CHARS} characters")
    return value
