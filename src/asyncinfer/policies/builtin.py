"""The built-in policies, registered through entry points like a third-party policy's."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from attrs import Attribute, field, frozen

from asyncinfer.errors import ConfigError
from asyncinfer.policies.base import Decision, RunningRequest, SchedulerView, WaitingRequest
from asyncinfer.policies.view import candidates, fresh

_Validator = Callable[[Any, "Attribute[Any]", Any], None]


def _is_number(value: Any) -> bool:
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
    return float(value) if _is_number(value) else value


def _fcfs(view: SchedulerView) -> Decision:
    """The queue front, as many as the free rows can take (the batch of offering all)."""
    return Decision.prefill((r.uid for r in fresh(view.waiting, view.free_slots + 1)), "stop")


@frozen
class PrefillFirst:
    """Prefill whenever anything waits, first come first served; decode otherwise."""

    name = "prefill_first"
    options: ClassVar[dict[str, str]] = {}

    def decide(self, view: SchedulerView) -> Decision:
        return _fcfs(view) if view.waiting else Decision.decode()


@frozen
class DecodeFirst:
    """Decode while anything runs; prefill FCFS when nothing runs or the cap is hit.

    Fairness: at most ``max_decode_rounds`` decodes in a row while admissible work waits."""

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

    Bound: admitted within ``old_after + (A + 1) * (D + C + 1)`` rounds of arrival (A
    unfinished earlier arrivals, D the largest max_tokens, C the most chunks of one request).
    See docs/architecture.md, 'Policies'."""

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
        return math.ceil(self.threshold / self.aging)

    def priority(self, req: WaitingRequest) -> float:
        """Older and smaller is higher."""
        return self.aging * req.waited_rounds - req.prefill_remaining

    def rank(self, req: WaitingRequest) -> float:
        """Lower is higher priority; fixed while it waits (``priority`` less a constant)."""
        return self.aging * req.arrival_round + req.prefill_remaining

    def decide(self, view: SchedulerView) -> Decision:
        """Prefill by priority (skipping misfits), or old requests first (stopping)."""
        if not view.waiting:
            return Decision.decode()
        order = view.waiting.ordered((self.name, self.aging), self.rank)
        uids, on_misfit = candidates(view.waiting, view.free_slots, order, self.old_after,
                                     "skip")
        return Decision.prefill(uids, on_misfit)


@frozen
class LongestPrefixMatch:
    """Admit the longest prefix-cache match first; one that waited long goes first.

    Bound: admitted within ``max_wait_rounds + (A + 1) * (D + C + 1)`` rounds of arrival,
    as skip_ahead's. See docs/architecture.md, 'Policies'."""

    name = "lpm"
    options: ClassVar[dict[str, str]] = {
        "max_wait_rounds": "rounds a request may wait before it goes first, in arrival "
                           "order, and nothing passes it (>= 0; 0 is FCFS)",
    }

    max_wait_rounds: int = field(default=64, validator=_int_at_least(0))

    @property
    def old_after(self) -> int:
        return self.max_wait_rounds

    def decide(self, view: SchedulerView) -> Decision:
        """The old in arrival order, then the longest match first; stop at a misfit."""
        if not view.waiting:
            return Decision.decode()
        order = view.waiting.longest_match_first()
        uids, on_misfit = candidates(view.waiting, view.free_slots, order, self.old_after,
                                     "stop")
        return Decision.prefill(uids, on_misfit)


def _optional_int_at_least(minimum: int) -> _Validator:
    check = _int_at_least(minimum)

    def optional(policy: Any, attribute: Attribute[Any], value: Any) -> None:
        if value is not None:
            check(policy, attribute, value)
    return optional


@frozen
class StallFree:
    """Every running request decodes every round; prefill chunks fill the rest of the budget.

    Half-done chunk first, then FCFS, stopping at the first misfit (Sarathi-Serve's
    stall-free batching). No stall: a running request decodes every round (but while a
    suspect runs alone). Bound: admitted within ``(A + 1) * (C + D + 1)`` rounds of arrival
    (A unfinished earlier arrivals, D the largest max_tokens, C the most chunks of one
    prompt). See docs/architecture.md, 'Policies'."""

    name = "stall_free"
    options: ClassVar[dict[str, str]] = {
        "token_budget": "tokens per round, one per decoding request included (>= 1; default: "
                        "the engine's max_extend_tokens)",
    }

    token_budget: int | None = field(default=None, validator=_optional_int_at_least(1))

    def decide(self, view: SchedulerView) -> Decision:
        """Decode all and prefill FCFS in the rest; with nothing running, the engine's budget."""
        if not view.waiting:
            return Decision.decode()
        budget = self.token_budget if view.running else None  # no stream to stall
        front = fresh(view.waiting, view.free_slots + 1)  # the batch of offering all
        return Decision.mixed((r.uid for r in front), "stop", token_budget=budget)


@frozen
class Priority:
    """By request priority (lower first), aged; a misfit preempts worse-priority requests.

    Bound: one arriving while a worse one runs is admitted next round, if that makes room.
    See docs/architecture.md, 'Policies'."""

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

    def rank(self, req: WaitingRequest) -> float:
        """``effective`` plus a constant of the round: fixed while it waits."""
        return req.priority + self.aging * req.arrival_round

    def decide(self, view: SchedulerView) -> Decision:
        """Prefill by effective priority (stopping at a misfit), preempting for it."""
        if not view.waiting:
            return Decision.decode()
        key = (self.name, self.aging)
        victims = (_preemptions(view.waiting.ordered(key, self.rank), view, self.effective,
                                self.aging) if self.preempt else ())
        order = fresh(view.waiting.ordered(key, self.rank), view.free_slots + len(victims) + 1)
        return Decision.prefill((req.uid for req in order), "stop", victims)


def _preemptions(order: Iterable[WaitingRequest], view: SchedulerView,
                 effective: Callable[[WaitingRequest], float], aging: float) -> tuple[int, ...]:
    """Running requests to preempt, worst first, so the first candidates get a slot. Walks
    the order only as far as admission would get; sorts the running set only when a
    candidate lacks a row and something worse runs."""
    def aged(r: RunningRequest) -> float:
        return r.priority - aging * (view.round - r.arrival_round)

    pool: list[RunningRequest] | None = None
    worst = view.running.worst_priority()
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
        # Only a missing slot preempts: preempting for reserved pages could cycle.
        while slots < 1 and worst is not None and worst > req.priority:
            if pool is None:
                pool = sorted(view.running, key=lambda r: (-aged(r), -r.arrival_round, -r.uid))
            victim = next((r for r in pool if r.priority > req.priority and aged(r) > mine),
                          None)
            if victim is None:
                break
            pool.remove(victim)
            chosen.append(victim.uid)
            slots += 1
            pages += -(-victim.seq_len // view.page_size)
        if slots < 1 or pages < need:
            break  # admission stops here
        slots, pages, budget = slots - 1, pages - need, budget - chunk
    return tuple(chosen)
