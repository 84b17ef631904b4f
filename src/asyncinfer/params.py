"""Sampling parameters of one request, validated where the user hands them in.

Every value is range-checked here, so that nothing a request carries can fail a batch it
shares with other requests (an integer too large for the sampler's int64 tensors, a
temperature whose inverse overflows, a NaN).
"""

from __future__ import annotations

import math
from typing import Any

from attrs import evolve, field, frozen

from asyncinfer.errors import InvalidRequestError

# Below this temperature a request samples greedily: 1 / temperature would blow the logits
# up to inf in float32 (1e-40 does), and the distribution is an argmax long before that.
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 100.0
# Integer fields go into int32 or int64 tensors and counters: keep them in a range that fits.
MAX_INT32 = 2**31 - 1
SEED_RANGE = (-(2**63), 2**64 - 1)   # two's-complement or unsigned 64 bits (taken mod 2**64)
MAX_TENANT_CHARS = 256              # a tenant name, as the OpenAI `user` field or a header


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
    """How to sample one request: the knobs of vLLM/OpenAI with the same meaning.

    ``temperature == 0`` is greedy, and so is any temperature below ``MIN_TEMPERATURE``
    (1e-2): such a request samples the argmax. ``top_k`` of -1 or 0, ``top_p == 1`` and
    ``min_p == 0`` disable their filters; a ``top_k`` at least the vocabulary size disables it
    too. A ``seed`` (any integer in 64 bits, signed or not) makes the request's samples
    independent of what else is batched. ``priority`` (an integer, lower first, as vLLM's)
    is read by policies that order by it, such as ``priority``; others ignore it. ``tenant``
    names whom the request is served for (the OpenAI ``user`` field or an ``X-Tenant``
    header on the server; at most ``MAX_TENANT_CHARS`` characters); fair-share policies such
    as ``vtc`` share the engine between tenants, others ignore it.
    Out-of-range values raise :class:`~asyncinfer.errors.InvalidRequestError` naming the
    field.
    """

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
        _check(_is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_INT32, "max_tokens",
               f"must be an integer in [1, {MAX_INT32}], got {self.max_tokens!r}")
        _check(_is_finite(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE,
               "temperature", f"must be a finite number in [0, {MAX_TEMPERATURE:g}], "
               f"got {self.temperature!r}")
        _check(_is_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p",
               f"must be a finite number in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and -1 <= self.top_k <= MAX_INT32, "top_k",
               f"must be an integer in [-1, {MAX_INT32}] (-1 or 0 disables it), "
               f"got {self.top_k!r}")
        _check(_is_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p",
               f"must be a finite number in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or (_is_int(self.seed)
                                     and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]),
               "seed", f"must be null or an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        _check(_is_int(self.priority) and -MAX_INT32 <= self.priority <= MAX_INT32, "priority",
               f"must be an integer in [{-MAX_INT32}, {MAX_INT32}], got {self.priority!r}")
        _check(isinstance(self.tenant, str) and len(self.tenant) <= MAX_TENANT_CHARS, "tenant",
               f"must be a string of at most {MAX_TENANT_CHARS} characters, "
               f"got {self.tenant!r:.80}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               f"must be a non-empty string or a list of them, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax: a temperature below ``MIN_TEMPERATURE``
        (0 included), or ``top_k == 1``."""
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
