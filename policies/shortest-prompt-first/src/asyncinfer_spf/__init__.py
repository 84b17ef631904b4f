"""Shortest prompt first: an out-of-tree asyncinfer policy, found through its entry point."""

from __future__ import annotations

from typing import Any, ClassVar

from attrs import Attribute, field, frozen

from asyncinfer.errors import ConfigError
from asyncinfer.policies import Decision, SchedulerView

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
        # Position in view.waiting is arrival order: the tie-break every rank agrees on.
        shortest = [req for _, req in sorted(
            enumerate(view.waiting), key=lambda item: (item[1].prefill_remaining, item[0]))]
        starved = [req for req in view.waiting if req.waited_rounds >= self.max_wait_rounds]
        if not starved:
            return Decision.prefill((req.uid for req in shortest), "skip")
        rest = [req for req in shortest if req.waited_rounds < self.max_wait_rounds]
        return Decision.prefill((req.uid for req in starved + rest), "stop")
