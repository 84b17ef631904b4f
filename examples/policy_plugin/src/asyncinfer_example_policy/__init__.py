"""An example asyncinfer scheduling policy, published through the ``asyncinfer.policies``
entry-point group: shortest output first, with aging.

It is a template to copy, not a policy asyncinfer ships: one class that implements the
``Policy`` protocol (a ``name``, ``decide(view) -> Decision``), and one entry point in
``pyproject.toml``. asyncinfer builds it by name with the user's options as keywords
(``--policy shortest_output_first --policy-opt aging=0.5``).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from attrs import Attribute, field, frozen

from asyncinfer.errors import ConfigError
from asyncinfer.policies import Decision, SchedulerView, WaitingRequest

__all__ = ["ShortestOutputFirst"]


def _aging(policy: Any, attribute: Attribute[Any], value: Any) -> None:
    """Options come from the command line and from Python: refuse a bad one by name."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 0):
        raise ConfigError(f"{policy.name}: option {attribute.name} must be a finite number "
                          f">= 0, got {value!r}")


@frozen
class ShortestOutputFirst:
    """Prefill the waiting request with the fewest output tokens to go first.

    A short answer then never waits behind long generations it arrived with: each request
    ranks by ``remaining_tokens - aging * waited_rounds`` (lowest first; ties in arrival order),
    and admission stops at the first candidate that does not fit, so nothing passes the
    request at the head of that order.

    Option ``aging`` (>= 0, default 1.0): how far a request's rank drops per round it
    waits. With ``aging > 0`` no request that arrives more than ``m / aging`` rounds after
    one with budget ``m`` is ever put before it (its rank is higher by more than its own
    budget), so every request waits only for those that arrived by then. With ``aging=0``
    a steady stream of short requests can hold a long one back indefinitely.

    Deterministic, as every policy must be (each tensor-parallel rank decides on its own):
    the rank depends on the view alone, with ties broken by position in ``view.waiting``.
    """

    name = "shortest_output_first"
    # The options asyncinfer accepts (``asyncinfer policies`` lists them with this help).
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
        order = sorted(enumerate(view.waiting), key=lambda item: (self.rank(item[1]), item[0]))
        return Decision.prefill((request.uid for _, request in order), "stop")
