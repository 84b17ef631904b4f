"""The built-in policies: prefill_first, decode_first and skip_ahead.

They are registered in the ``asyncinfer.policies`` entry-point group of pyproject.toml and
loaded through it, exactly like a third-party policy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

from attrs import Attribute, field, frozen

from asyncinfer.errors import ConfigError
from asyncinfer.policies.base import Decision, RunningRequest, SchedulerView, WaitingRequest

_Validator = Callable[[Any, "Attribute[Any]", Any], None]


def _is_number(value: Any) -> bool:
    # bool is an int subclass, but `aging=true` is a typo, not a number.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_at_least(minimum: int) -> _Validator:
    def check(policy: Any, attribute: Attribute[Any], value: Any) -> None:
        if not (isinstance(value, int) and _is_number(value) and value >= minimum):
            raise ConfigError(f"{policy.name}: option {attribute.name} must be an integer "
                              f">= {minimum}, got {value!r}")
    return check


def _float_above(minimum: float, *, inclusive: bool) -> _Validator:
    relation = ">=" if inclusive else ">"

    def check(policy: Any, attribute: Attribute[Any], value: Any) -> None:
        ok = _is_number(value) and math.isfinite(value) and (
            value >= minimum if inclusive else value > minimum)
        if not ok:
            raise ConfigError(f"{policy.name}: option {attribute.name} must be a finite number "
                              f"{relation} {minimum}, got {value!r}")
    return check


def _as_float(value: Any) -> Any:
    """Integers become floats (``aging=1`` from the command line); anything else is left
    for the validator to judge."""
    return float(value) if _is_number(value) else value


def _by(view: SchedulerView, key: Callable[[WaitingRequest], float]
        ) -> list[WaitingRequest]:
    """The waiting requests by ``key``, lowest first; ties in arrival order (a request's
    position in ``view.waiting``), the tie-break every rank agrees on."""
    return [req for _, req in sorted(enumerate(view.waiting),
                                     key=lambda item: (key(item[1]), item[0]))]


def _fcfs(view: SchedulerView) -> Decision:
    return Decision.prefill((req.uid for req in view.waiting), "stop")


@frozen
class PrefillFirst:
    """Prefill whenever anything waits, first come first served; decode otherwise.

    The seed's rule. Candidates are every waiting request in arrival order, and admission
    stops at the first one that does not fit. No options.

    Fairness: each prefill admits a prefix of the waiting queue in arrival order, so a
    request is never overtaken; it waits only for the requests that arrived before it.
    """

    name = "prefill_first"
    options: ClassVar[dict[str, str]] = {}

    def decide(self, view: SchedulerView) -> Decision:
        """Prefill FCFS if anything waits, else decode."""
        return _fcfs(view) if view.waiting else Decision.decode()


@frozen
class DecodeFirst:
    """Decode while anything runs, prefilling FCFS only when nothing runs or the cap is hit.

    Option ``max_decode_rounds`` (integer >= 1, default 4): once that many decode rounds
    have run in a row while a request waits, the next round prefills (FCFS, stop at the
    first that does not fit).

    Fairness: never more than ``max_decode_rounds`` decode rounds in a row while admissible
    prefill work waits.
    """

    name = "decode_first"
    options: ClassVar[dict[str, str]] = {
        "max_decode_rounds": "decode rounds in a row at most while a request waits (>= 1)",
    }

    max_decode_rounds: int = field(default=4, validator=_int_at_least(1))

    def decide(self, view: SchedulerView) -> Decision:
        """Decode, unless nothing runs or the decode streak has reached the cap."""
        if not view.waiting:
            return Decision.decode()
        if not view.running or view.decode_streak >= self.max_decode_rounds:
            return _fcfs(view)
        return Decision.decode()


@frozen
class SkipAhead:
    """Smaller requests may pass a blocked one; waiting raises priority so nothing starves.

    A waiting request's priority is ``aging * waited_rounds - prefill_remaining``: older and
    smaller first, ties by arrival order. A request is *old* once
    ``aging * waited_rounds >= threshold``, that is after ``old_after = ceil(threshold /
    aging)`` rounds of waiting. While no request is old, the candidates are every waiting
    request by priority and one that does not fit is skipped. Once any request is old, the
    old ones come first in arrival order, then the rest by priority, and admission stops at
    the first that does not fit: nothing overtakes an old request until it runs. It prefills
    whenever anything waits, like prefill_first (the scheduler decodes when a prefill admits
    nothing).

    Options: ``aging`` (> 0, default 1.0), priority gained per round of waiting;
    ``threshold`` (>= 0, default 64.0), the aged priority at which a request becomes old.
    ``threshold=0`` makes every request old at once: first come first served.

    Fairness, the bound: a request that fits in an empty engine becomes old after at most
    ``ceil(threshold / aging)`` rounds of waiting; from then on only requests older than it
    can be admitted before it, so it is admitted within
    ``ceil(threshold / aging) + (A + 1) * (D + C + 1)`` rounds of its arrival, where A is the
    number of requests that arrived before it and are still unfinished, D the largest
    max_tokens, and C the most prefill chunks one request needs.
    """

    name = "skip_ahead"
    options: ClassVar[dict[str, str]] = {
        "aging": "priority gained per round of waiting, in prompt tokens (> 0)",
        "threshold": "aged priority at which a request is old and nothing may pass it (>= 0)",
    }

    aging: float = field(default=1.0, converter=_as_float,
                         validator=_float_above(0.0, inclusive=False))
    threshold: float = field(default=64.0, converter=_as_float,
                             validator=_float_above(0.0, inclusive=True))

    def __attrs_post_init__(self) -> None:
        if not math.isfinite(self.threshold / self.aging):
            raise ConfigError(f"{self.name}: threshold / aging must be finite, got "
                              f"{self.threshold!r} / {self.aging!r}")

    @property
    def old_after(self) -> int:
        """Rounds of waiting after which a request is old: ``ceil(threshold / aging)``."""
        return math.ceil(self.threshold / self.aging)

    def priority(self, req: WaitingRequest) -> float:
        """Older and smaller is higher."""
        return self.aging * req.waited_rounds - req.prefill_remaining

    def decide(self, view: SchedulerView) -> Decision:
        """Prefill by priority (skipping misfits), or old requests first (stopping)."""
        if not view.waiting:
            return Decision.decode()
        by_priority = _by(view, lambda req: -self.priority(req))
        # Compared in whole rounds, so "old" is exactly the documented old_after.
        old = [req for req in view.waiting if req.waited_rounds >= self.old_after]
        if not old:
            return Decision.prefill((req.uid for req in by_priority), "skip")
        young = [req for req in by_priority if req.waited_rounds < self.old_after]
        return Decision.prefill((req.uid for req in old + young), "stop")


@frozen
class Priority:
    """By request priority (lower first), aged; a misfit preempts worse-priority requests.

    The request's ``priority`` is SamplingParams' (and the OpenAI body's, as vLLM's).

    Order: a waiting request's effective priority is ``priority - aging * waited_rounds``;
    candidates go lowest first (ties by arrival), and admission stops at the first that does
    not fit, so nothing overtakes it. Preemption (option ``preempt``, on by default): when
    the first candidates lack a request slot, running requests worse than the candidate
    both in priority and in effective priority (aged the same way, from their arrival) are
    named in the Decision, the worst effective priority first; the scheduler sends them back
    to the queue (their computed pages stay in the prefix cache) and they later continue
    where they stopped, with the tokens they would have produced anyway. Equal priorities
    never preempt each other, and since effective priorities keep their order as rounds
    pass (all age alike), a request never preempts one that preempted it: requests cannot
    take turns evicting each other, and the best-ordered request always finishes. It
    prefills whenever anything waits, like prefill_first.

    Options: ``aging`` (>= 0, default 0.0625: one priority level per 16 rounds of waiting);
    ``preempt`` (default true).

    Bounds: a request of priority p that arrives while a running request has a priority
    worse than p is admitted in the next round, if preempting the worse ones makes room for
    its first chunk. With ``aging > 0`` it is ordered ahead of every request that arrives
    more than ``(p - q) / aging`` rounds after it (q the best priority among those), so a
    stream of better-priority arrivals can delay it, not starve it.
    """

    name = "priority"
    options: ClassVar[dict[str, str]] = {
        "aging": "priority levels gained per round of waiting (>= 0)",
        "preempt": "preempt running requests of a worse priority (true or false)",
    }

    aging: float = field(default=0.0625, converter=_as_float,
                         validator=_float_above(0.0, inclusive=True))
    preempt: bool = field(default=True)

    @preempt.validator
    def _check_preempt(self, attribute: Attribute[Any], value: Any) -> None:
        if not isinstance(value, bool):
            raise ConfigError(f"{self.name}: option preempt must be true or false, got "
                              f"{value!r}")

    def effective(self, req: WaitingRequest) -> float:
        """Lower runs first: the request's priority, less what waiting has earned it."""
        return req.priority - self.aging * req.waited_rounds

    def decide(self, view: SchedulerView) -> Decision:
        """Prefill by effective priority (stopping at a misfit), preempting for it."""
        if not view.waiting:
            return Decision.decode()
        order = _by(view, self.effective)
        victims = _preemptions(order, view, self.effective, self.aging) if self.preempt else ()
        return Decision.prefill((req.uid for req in order), "stop", victims)


def _preemptions(order: list[WaitingRequest], view: SchedulerView,
                 effective: Callable[[WaitingRequest], float], aging: float) -> tuple[int, ...]:
    """The running requests to preempt so the first candidates of ``order`` get a request
    slot: for each candidate in turn (within a round's token budget), while no slot is free,
    the running request of the worst effective priority among those worse than the
    candidate in both priority and effective priority."""
    def aged(r: RunningRequest) -> float:
        return r.priority - aging * (view.round - r.arrival_round)

    pool = sorted(view.running, key=lambda r: (-aged(r), -r.arrival_round, -r.uid))
    slots, pages, budget = view.free_slots, view.free_pages, view.token_budget
    chosen: list[int] = []
    for req in order:
        if budget <= 0:
            break
        if req.chunked:  # it holds its row and pages already, and resumes first
            budget -= min(req.prefill_remaining, budget)
            continue
        chunk = min(req.prefill_remaining, budget)
        need = -(-(chunk + 1) // view.page_size)
        mine = effective(req)
        # Only a missing slot preempts: pages the scheduler may still hold back for running
        # requests are not the policy's to count, and preempting for them could cycle.
        while slots < 1:
            victim = next((r for r in pool if r.priority > req.priority and aged(r) > mine),
                          None)
            if victim is None:
                break
            pool.remove(victim)
            chosen.append(victim.uid)
            slots += 1
            pages += -(-victim.seq_len // view.page_size)
        if slots < 1 or pages < need:
            break  # it does not fit even so: admission stops here
        slots, pages, budget = slots - 1, pages - need, budget - chunk
    return tuple(chosen)
