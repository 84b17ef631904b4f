"""Sampling parameters of one request, and the bounds of its fields (:data:`BOUNDS`).

See docs/architecture.md, "Request bounds, validated once per process boundary".
"""

from __future__ import annotations

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
})


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
    are for policies. Outside :data:`BOUNDS`: InvalidRequestError naming the field."""

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

    def __attrs_post_init__(self) -> None:
        for name, bound in BOUNDS.items():
            value = getattr(self, name)
            if value is None and name == "seed":
                continue
            _check(bound.holds(value), name, f"must be {bound.describe()}, got {value!r}")
        _check(isinstance(self.tenant, str) and len(self.tenant) <= MAX_TENANT_CHARS
               and _is_utf8(self.tenant), "tenant",
               f"must be a UTF-8 string of at most {MAX_TENANT_CHARS} characters, "
               f"got {self.tenant!r:.80}")
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

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        return evolve(self, **changes)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite(v: object) -> bool:
    """A real number (not a bool), neither NaN nor infinite."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return isinstance(v, int) or math.isfinite(v)  # an int too large for a float is finite
