"""Sampling parameters of one request, validated where the user hands them in."""

from __future__ import annotations

from typing import Any

from attrs import evolve, field, frozen

from asyncinfer.errors import InvalidRequestError


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise InvalidRequestError(message)


def _as_stop(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@frozen
class SamplingParams:
    """How to sample one request: the knobs of vLLM/OpenAI with the same meaning.

    ``temperature == 0`` is greedy. ``top_k <= 0``, ``top_p == 1`` and ``min_p == 0`` disable
    their filters. A ``seed`` makes the request's samples independent of what else is batched.
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

    def __attrs_post_init__(self) -> None:
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_number(self.temperature) and 0.0 <= self.temperature <= 100.0,
               f"temperature must be a number in [0, 100], got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0,
               f"top_p must be a number in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k), f"top_k must be an integer, got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0,
               f"min_p must be a number in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or _is_int(self.seed),
               f"seed must be an integer or null, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop must be a non-empty string or a list of them, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        return evolve(self, **changes)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
