"""Sampling parameters of one request, and the bounds of its fields (:data:`BOUNDS`).

See docs/architecture.md, "Request bounds, validated once per process boundary".
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs
from attrs import evolve, field, frozen

from asyncinfer.errors import InvalidRequestError

# Below this temperature a request samples greedily: 1 / temperature would overflow float32
# logits long after the distribution is an argmax.
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 100.0
MAX_INT32 = 2**31 - 1
SEED_RANGE = (-(2**63), 2**64 - 1)   # two's-complement or unsigned 64 bits (taken mod 2**64)
MAX_TENANT_CHARS = 256              # a tenant name, as the OpenAI `user` field or a header
MAX_LOGPROBS = 20                   # top alternatives per position, as OpenAI allows
MAX_N = 16                          # choices per request (``n``, ``best_of``)
MAX_LOGIT_BIAS = 300                # entries of ``logit_bias``, as OpenAI allows
MAX_STOP_TOKEN_IDS = 64
MAX_GRAMMAR_CHARS = 64 * 1024       # a schema, regex, choice list or grammar, as text
# What ``structured`` constrains the output to: a JSON schema, any JSON object, a regex, one
# of a JSON list of strings, an EBNF (GBNF) grammar, or an xgrammar structural tag (JSON).
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@frozen
class Bound:
    """The range of one numeric field: ``[low, high]``, ``(low, high]`` with ``open_low``."""

    low: int | float
    high: int | float
    integer: bool
    open_low: bool = False
    shown: str | None = None    # how a message spells the range, where not by its numbers

    def holds(self, value: object) -> bool:
        if self.integer:
            if not _is_int(value):
                return False
        elif not _is_finite(value):
            return False
        assert isinstance(value, (int, float))
        return (self.low < value if self.open_low else self.low <= value) and value <= self.high

    def describe(self) -> str:
        """"an integer in [1, 2147483647]", "a finite number in (0, 1]"."""
        if self.integer:
            return f"an integer in {self.shown or f'[{self.low}, {self.high}]'}"
        return f"a finite number in {'(' if self.open_low else '['}{self.low:g}, {self.high:g}]"


BOUNDS: Mapping[str, Bound] = MappingProxyType({
    "max_tokens": Bound(1, MAX_INT32, integer=True),
    "temperature": Bound(0.0, MAX_TEMPERATURE, integer=False),
    "top_p": Bound(0.0, 1.0, integer=False, open_low=True),
    "top_k": Bound(-1, MAX_INT32, integer=True),
    "min_p": Bound(0.0, 1.0, integer=False),
    "seed": Bound(*SEED_RANGE, integer=True, shown="[-2**63, 2**64 - 1]"),
    "priority": Bound(-MAX_INT32, MAX_INT32, integer=True),
    "n": Bound(1, MAX_N, integer=True),
    "presence_penalty": Bound(-2.0, 2.0, integer=False),
    "frequency_penalty": Bound(-2.0, 2.0, integer=False),
    "repetition_penalty": Bound(0.0, 10.0, integer=False, open_low=True),
    "min_tokens": Bound(0, MAX_INT32, integer=True),
})
# Fields that may be None (off); when set they must hold their bound.
OPTIONAL_BOUNDS: Mapping[str, Bound] = MappingProxyType({
    "logprobs": Bound(0, MAX_LOGPROBS, integer=True),
    "prompt_logprobs": Bound(0, MAX_LOGPROBS, integer=True),
    "best_of": Bound(1, MAX_N, integer=True),
})
LOGIT_BIAS_BOUND = Bound(-100.0, 100.0, integer=False)
def _as_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` or (id, bias) pairs as sorted pairs (hashable, one per id)."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = {int(t) if isinstance(t, str) and t.lstrip("-").isdigit() else t: b
                 for t, b in items}
    except (TypeError, ValueError):
        raise InvalidRequestError(f"logit_bias must map token ids to numbers, got "
                                  f"{value!r:.80}", param="logit_bias") from None
    if not all(_is_int(t) for t in pairs):
        raise InvalidRequestError(f"logit_bias keys must be token ids, got {value!r:.80}",
                                  param="logit_bias")
    return tuple(sorted(pairs.items()))


def _as_structured(value: Any) -> tuple[str, str] | None:
    """``(kind, text)``, from itself, a list, or vLLM's one-key mapping (``{"json": schema}``,
    ``{"choice": [...]}``; a schema or list given as an object becomes its JSON text)."""
    if value is None:
        return None
    if isinstance(value, dict) and len(value) == 1:
        [(kind, spec)] = value.items()
        if kind == "json_object":
            spec = ""
        value = (kind, spec if isinstance(spec, str) else json.dumps(spec))
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return (value[0], value[1])
    raise InvalidRequestError(f"structured must be (kind, text) with kind one of "
                              f"{', '.join(STRUCTURED_KINDS)}, got {value!r:.80}",
                              param="structured")


def _as_ids(value: Any) -> tuple[int, ...]:
    return () if value is None else tuple(value)


def _is_utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8: a header's undecodable bytes arrive as surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check(cond: bool, param: str, message: str) -> None:
    if not cond:
        raise InvalidRequestError(f"{param} {message}", param=param)


def _as_stop(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@frozen
class SamplingParams:
    """vLLM's and OpenAI's sampling knobs: greedy below ``MIN_TEMPERATURE``; ``top_k`` -1 or 0
    is off; a ``seed`` is independent of the batch; ``priority`` (lower first) and ``tenant``
    are for policies. Outside :data:`BOUNDS`: InvalidRequestError naming the field.

    ``logprobs``: the sampled token's log-probability and this many top alternatives per
    output token (None: none); ``prompt_logprobs`` likewise per prompt token (with it,
    ``max_tokens`` may be 0: the prompt is scored, nothing sampled). Both come from
    the model's raw log-softmax, before penalties, bias, temperature and filters (as vLLM's
    default). ``n`` choices are returned (the best ``n`` of ``best_of`` when set), sharing the
    prompt's prefill. Penalties follow OpenAI (presence, frequency: over the output so far) and
    vLLM (``repetition_penalty``: over prompt and output); ``logit_bias`` adds to the logits;
    ``min_tokens`` holds EOS and ``stop_token_ids`` back until that many tokens exist.
    ``structured`` (kind, text) constrains the output (see ``STRUCTURED_KINDS``); EOS only
    once it is complete; ``structured_field`` names it in errors (the client's field)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=(), converter=_as_stop)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    tenant: str = ""
    n: int = 1
    best_of: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default=(), converter=_as_bias)
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = field(default=(), converter=_as_ids)
    structured: tuple[str, str] | None = field(default=None, converter=_as_structured)
    structured_field: str = "structured"

    def __attrs_post_init__(self) -> None:
        for name, bound in BOUNDS.items():
            value = getattr(self, name)
            if value is None and name == "seed":
                continue
            if name == "max_tokens" and _is_int(value) and value == 0:
                _check(self.prompt_logprobs is not None, name,
                       f"must be {bound.describe()}, or 0 with prompt_logprobs (a request "
                       "that scores its prompt and samples nothing), got 0")
                continue
            _check(bound.holds(value), name, f"must be {bound.describe()}, got {value!r}")
        for name, bound in OPTIONAL_BOUNDS.items():
            value = getattr(self, name)
            _check(value is None or bound.holds(value), name,
                   f"must be {bound.describe()} or null, got {value!r}")
        _check(self.best_of is None or self.best_of >= self.n, "best_of",
               f"must be at least n ({self.n}), got {self.best_of!r}")
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias",
               f"may hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        bad = next((b for _, b in self.logit_bias if not LOGIT_BIAS_BOUND.holds(b)), None)
        _check(bad is None, "logit_bias",
               f"values must be {LOGIT_BIAS_BOUND.describe()}, got {bad!r}")
        _check(all(t >= 0 for t, _ in self.logit_bias), "logit_bias",
               "keys must be token ids (non-negative integers)")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
               and all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               f"must be at most {MAX_STOP_TOKEN_IDS} token ids, got "
               f"{self.stop_token_ids!r:.80}")
        _check(self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check(isinstance(self.tenant, str) and len(self.tenant) <= MAX_TENANT_CHARS
               and _is_utf8(self.tenant), "tenant",
               f"must be a UTF-8 string of at most {MAX_TENANT_CHARS} characters, "
               f"got {self.tenant!r:.80}")
        if self.structured is not None:
            kind, text = self.structured
            field_name = self.structured_field
            _check(kind in STRUCTURED_KINDS and isinstance(text, str), field_name,
                   f"must be one of {', '.join(STRUCTURED_KINDS)} with its text, got "
                   f"{kind!r:.40}")
            _check(len(text) <= MAX_GRAMMAR_CHARS, field_name,
                   f"may be at most {MAX_GRAMMAR_CHARS} characters, got {len(text)}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               f"must be a non-empty string or a list of them, got {self.stop!r}")

    @classmethod
    def prechecked(cls, **fields: Any) -> SamplingParams:
        """Fields a process boundary checked against :data:`BOUNDS` already (the HTTP
        models do): built without checking them a second time."""
        params = object.__new__(cls)
        for attribute in attrs.fields(cls):
            value = fields.pop(attribute.name, attribute.default)
            if attribute.converter is not None:
                value = attribute.converter(value)
            object.__setattr__(params, attribute.name, value)
        if fields:
            raise TypeError(f"not sampling parameters: {', '.join(sorted(fields))}")
        return params

    @property
    def greedy(self) -> bool:
        """Sampling reduces to argmax (temperature below ``MIN_TEMPERATURE``, or top_k 1)."""
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether the sampler changes this row's logits (penalties or bias)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias)

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse token ids the model cannot produce (``logit_bias``, ``stop_token_ids``)."""
        bad = next((t for t, _ in self.logit_bias if t >= vocab_size), None)
        _check(bad is None, "logit_bias",
               f"has token id {bad} outside the vocabulary [0, {vocab_size})")
        bad = next((t for t in self.stop_token_ids if t >= vocab_size), None)
        _check(bad is None, "stop_token_ids",
               f"has token id {bad} outside the vocabulary [0, {vocab_size})")

    @property
    def choices(self) -> int:
        """How many sequences the request samples (``best_of``, else ``n``)."""
        return self.best_of or self.n

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        return evolve(self, **changes)


_SEED_STEP = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: choices' seeds far apart


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded ``seed`` (choice 0 keeps it): each
    choice its own stream, so a seeded ``n`` > 1 request is reproducible and its choices
    differ. None stays None (unseeded choices draw from the sampler's own keys)."""
    if seed is None or index == 0:
        return seed
    return (seed + index * _SEED_STEP) & (2**64 - 1)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite(v: object) -> bool:
    """A real number (not a bool), neither NaN nor infinite."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return isinstance(v, int) or math.isfinite(v)  # an int too large for a float is finite
