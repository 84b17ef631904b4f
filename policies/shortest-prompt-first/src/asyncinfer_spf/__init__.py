"""Shortest prompt first: an out-of-tree asyncinfer policy, found through its entry point."""

from __future__ import annotations

from typing import Any, ClassVar

from attrs import Attribute, field, frozen

from asyncinfer.errors import ConfigError
from asyncinfer.policies import Decision, SchedulerView, candidates

__all__ = ["ShortestPromptFirst"]


def _positive_int(policy: Any, attribute: Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{policy.name}: option {attribute.name} must be an integer >= 1, "
                          f"got {value!r}")


@frozen
class ShortestPromptFirst:
    """Prefill the request with the least prompt left first; a long wait puts one in front.

    Misfits are skipped; requests that waited ``max_wait_rounds`` go first and stop."""

    name = "shortest_prompt_first"
    options: ClassVar[dict[str, str]] = {
        "max_wait_rounds": "rounds a request may wait before it goes first and nothing "
                           "skips it (>= 1)",
    }

    max_wait_rounds: int = field(default=256, validator=_positive_int)

    def decide(self, view: SchedulerView) -> Decision:
        """Shortest first, skipping misfits; starved requests first, stopping."""
        if not view.waiting:
            return Decision.decode()
        # An index kept by the scheduler, ties in queue order (the one every rank agrees on);
        # a bounded window of it is offered, so a round costs the same at any queue depth.
        shortest = view.waiting.ordered(self.name, lambda req: req.prefill_remaining)
        uids, on_misfit = candidates(view.waiting, view.free_slots, shortest,
                                     self.max_wait_rounds, "skip")
        return Decision.prefill(uids, on_misfit)
