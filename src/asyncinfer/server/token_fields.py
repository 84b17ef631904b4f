"""The request fields that name token ids, ``logit_bias`` and ``stop_token_ids``: their
schemas and checks against the served vocabulary (a failed check is the field's 400)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import WithJsonSchema

from asyncinfer.params import LOGIT_BIAS_BOUND, MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS

LogitBias = Annotated[dict[str, Any] | None, WithJsonSchema({
    "anyOf": [{"type": "object", "maxProperties": MAX_LOGIT_BIAS,
               "propertyNames": {"pattern": "^[0-9]+$"},
               "additionalProperties": {"type": "number", "minimum": LOGIT_BIAS_BOUND.low,
                                        "maximum": LOGIT_BIAS_BOUND.high}},
              {"type": "null"}],
    "description": "token id (a string, as OpenAI's) to a bias added to its logit"})]
StopTokenIds = Annotated[list[Any] | None, WithJsonSchema({
    "anyOf": [{"type": "array", "maxItems": MAX_STOP_TOKEN_IDS,
               "items": {"type": "integer", "minimum": 0}}, {"type": "null"}],
    "description": "token ids that end the output (finish_reason stop; not in the text)"})]


def check_logit_bias(value: dict[str, Any] | None, vocab: int) -> dict[str, Any] | None:
    """OpenAI's ``{"token id": bias}``: at most 300 ids of the vocabulary, each biased by a
    number in [-100, 100]."""
    if value is None:
        return None
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"may hold at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and int(key) < vocab):
            raise ValueError(f"key {key[:40]!r} is not a token id of the vocabulary "
                             f"[0, {vocab})")
        if not LOGIT_BIAS_BOUND.holds(bias):
            raise ValueError(f"the bias of token {key} must be "
                             f"{LOGIT_BIAS_BOUND.describe()}, got {bias!r:.40}")
    return value


def check_stop_token_ids(value: list[Any] | None, vocab: int) -> list[int] | None:
    """At most 64 token ids of the vocabulary (JSON's ``2.0`` taken as 2)."""
    if value is None:
        return None
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"may hold at most {MAX_STOP_TOKEN_IDS} token ids, got {len(value)}")
    ids = [int(t) if isinstance(t, float) and t.is_integer() else t for t in value]
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int)
                or not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"has {bad!r:.40}, not a token id of the vocabulary [0, {vocab})")
    return ids
