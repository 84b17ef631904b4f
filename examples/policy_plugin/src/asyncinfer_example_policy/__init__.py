"""A template scheduling policy, published through the ``asyncinfer.policies`` entry
points: shortest output first, with aging (``--policy-opt aging=0.5``)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from attrs import Attribute, field, frozen

from asyncinfer.errors import ConfigError
from asyncinfer.policies import Decision, SchedulerView, WaitingRequest, fresh

__all__ = ["ShortestOutputFirst"]


def _aging(policy: Any, attribute: Attribute[Any], value: Any) -> None:  # refused by name
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 0):
        raise ConfigError(f"{policy.name}: option {attribute.name} must be a finite number "
                          f">= 0, got {value!r}")


@frozen
class ShortestOutputFirst:
    """Prefill by ``remaining_tokens - aging * waited_rounds``, lowest first, ties in arrival
    order, stopping at the first misfit. Deterministic: the rank depends on the view alone."""

    name = "shortest_output_first"
    options: ClassVar[dict[str, str]] = {
        "aging": "rank drop per round waited, against starvation (>= 0)",
    }

    aging: float = field(default=1.0, validator=_aging)

    def rank(self, request: WaitingRequest) -> float:
        """Lower goes first."""
        return request.remaining_tokens - self.aging * request.waited_rounds

    def decide(self, view: SchedulerView) -> Decision:
        """Prefill by rank when anything waits (stopping at a misfit), else decode."""
        if not view.waiting:
            return Decision.decode()
        # An order the scheduler keeps up to date, by a key fixed while a request waits (the
        # rank plus aging * round), ties in queue order; stopping at a misfit, the free rows
        # take at most free_slots + 1: so a round costs the same at any queue depth.
        order = view.waiting.ordered(
            (self.name, self.aging), lambda r: r.remaining_tokens + self.aging * r.arrival_round)
        return Decision.prefill((r.uid for r in fresh(order, view.free_slots + 1)), "stop")
