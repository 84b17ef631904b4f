"""The policy's view of a deep queue: a round reads no more of the queue than its policy
needs, the bounded candidate lists give the batches that offering the whole queue gives, and
the queue's indexes follow arrivals, preemptions and departures."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from asyncinfer.config import EngineConfig
from asyncinfer.params import SamplingParams
from asyncinfer.policies.base import Decision, Policy, SchedulerView, WaitingRequest
from asyncinfer.policies.builtin import (
    DecodeFirst,
    LongestPrefixMatch,
    PrefillFirst,
    Priority,
    SkipAhead,
    _preemptions,
)
from asyncinfer.scheduler.scheduler import Scheduler
from tests.fake_engine import FakeEngine

POLICIES = [PrefillFirst(), DecodeFirst(), SkipAhead(), SkipAhead(threshold=3.0), Priority(),
            Priority(preempt=False), LongestPrefixMatch(), LongestPrefixMatch(max_wait_rounds=4)]


def counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the waiting records the scheduler builds for its policy."""
    built = [0]
    make = Scheduler._waiting_record

    def record(self: Scheduler, req: Any) -> WaitingRequest:
        built[0] += 1
        return make(self, req)

    monkeypatch.setattr(Scheduler, "_waiting_record", record)
    return built


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_a_round_reads_no_more_of_a_deep_queue_than_the_rows_can_take(
        policy: Policy, monkeypatch: pytest.MonkeyPatch) -> None:
    """4 rows decode long requests while 3,000 wait: after the first round (which builds
    an index once), a round reads at most a handful of records, not the queue."""
    built = counting(monkeypatch)
    engine = FakeEngine(num_pages=256, page_size=4, max_rows=4, context_len=256)
    sched = Scheduler(engine, policy, EngineConfig(max_extend_tokens=64), frozenset())
    for uid in range(3000):
        sched.add_request(uid, [1 + uid % 40, 2, 3], SamplingParams(max_tokens=200, priority=1))
    for _ in range(3):
        sched.step()
    assert len(sched.running) == 4 and len(sched.waiting) == 2996
    per_round = []
    for _ in range(30):
        before = built[0]
        sched.step()
        per_round.append(built[0] - before)
    assert max(per_round) <= 2, per_round
    sched.check_invariants()


# ---- the same batches as offering everything ------------------------------------------------

def _all_fcfs(view: SchedulerView) -> Decision:
    return Decision.prefill((r.uid for r in view.waiting), "stop")


def _all_skip_ahead(policy: SkipAhead) -> Callable[[SchedulerView], Decision]:
    def decide(view: SchedulerView) -> Decision:  # the whole queue, sorted each round
        by_priority = sorted(enumerate(view.waiting), key=lambda i: (-policy.priority(i[1]),
                                                                     i[0]))
        ranked = [r for _, r in by_priority]
        old = [r for r in view.waiting if r.waited_rounds >= policy.old_after]
        if not old:
            return Decision.prefill((r.uid for r in ranked), "skip")
        young = [r for r in ranked if r.waited_rounds < policy.old_after]
        return Decision.prefill((r.uid for r in old + young), "stop")
    return decide


def _all_priority(policy: Priority) -> Callable[[SchedulerView], Decision]:
    def decide(view: SchedulerView) -> Decision:
        order = [r for _, r in sorted(enumerate(view.waiting),
                                      key=lambda i: (policy.effective(i[1]), i[0]))]
        victims = _preemptions(order, view, policy.effective, policy.aging)
        return Decision.prefill((r.uid for r in order), "stop", victims)
    return decide


class _Reference:
    """A policy's rule applied to the whole queue, as before views were lazy."""

    def __init__(self, policy: Policy) -> None:
        self.name, self.policy = policy.name, policy
        if isinstance(policy, SkipAhead):
            self._decide = _all_skip_ahead(policy)
        elif isinstance(policy, Priority):
            self._decide = _all_priority(policy)
        elif isinstance(policy, DecodeFirst):
            self._decide = lambda v: (policy.decide(v) if policy.decide(v).action == "decode"
                                      else _all_fcfs(v))
        else:
            self._decide = lambda v: _all_fcfs(v) if v.waiting else Decision.decode()

    def decide(self, view: SchedulerView) -> Decision:
        if not view.waiting:
            return Decision.decode()
        return self._decide(view)


def trace(policy: Policy, seed: int, cache_type: str = "radix") -> list[tuple[Any, ...]]:
    """Deep bursty traffic with priorities and shared prefixes over 4 rows and a short
    pool; the batches launched and the events."""
    rng = random.Random(seed)
    engine = FakeEngine(num_pages=40, page_size=4, max_rows=4, context_len=96, eos_every=17)
    config = EngineConfig(cache_type=cache_type,  # type: ignore[arg-type]
                          max_extend_tokens=24, chunked_prefill=True)
    sched = Scheduler(engine, policy, config, frozenset({0}))
    out: list[tuple[Any, ...]] = []
    uid = 0
    for step in range(400):
        if step % 40 == 0:
            for _ in range(rng.randrange(20, 60)):
                prompt = [7] * rng.choice([0, 8, 12]) + [rng.randrange(1, 50)
                                                         for _ in range(rng.randrange(1, 30))]
                sched.add_request(uid, prompt, SamplingParams(
                    max_tokens=rng.randrange(1, 20), priority=rng.randrange(0, 3)))
                uid += 1
        events = sched.step()
        if sched.last_scheduled is not None:
            b = sched.last_scheduled.batch
            out.append((step, b.rows, b.starts, b.ends, [(e.uid, e.token) for e in events]))
    return out


@pytest.mark.parametrize("policy", [PrefillFirst(), DecodeFirst(max_decode_rounds=2),
                                    SkipAhead(aging=1.0, threshold=6.0), Priority(),
                                    Priority(aging=0.5)], ids=lambda p: p.name)
def test_offering_a_bounded_front_gives_the_batches_offering_the_whole_queue_gives(
        policy: Policy) -> None:
    for seed in range(3):
        assert trace(policy, seed) == trace(_Reference(policy), seed), seed


# ---- the queue ------------------------------------------------------------------------------

def test_the_queue_keeps_arrival_order_with_preempted_requests_in_front() -> None:
    engine = FakeEngine(num_pages=64, page_size=4, max_rows=2, context_len=64)
    sched = Scheduler(engine, PrefillFirst(), EngineConfig(max_extend_tokens=64), frozenset())
    for uid in range(5):
        sched.add_request(uid, [uid + 1] * 6, SamplingParams(max_tokens=8,
                                                             tenant="ab"[uid % 2]))
    sched.step()
    assert sorted(sched.running) == [0, 1]
    running = sched.view().running
    assert [r.uid for r in running] == [0, 1] and running[-1].uid == 1 and len(running) == 2
    assert [r.uid for r in running[:1]] == [0] and running.worst_priority() == 0
    order = SkipAhead(threshold=0.0).decide(sched.view())  # builds an index too
    assert order.candidates == (2,)  # no row is free: the first is as far as it gets
    sched.view().waiting.ordered("by prompt", lambda r: -r.uid)
    assert sched.preempt(1) and sched.preempt(0)
    view = sched.view()
    assert [r.uid for r in view.waiting] == [0, 1, 2, 3, 4]
    assert [r.uid for r in view.waiting.of_tenant("b")] == [1, 3]
    assert [r.uid for r in view.waiting.ordered("by prompt", lambda r: -r.uid)] == [
        4, 3, 2, 1, 0]
    assert [r.uid for r in view.waiting.waited_at_least(1)] == [0, 1, 2, 3, 4]
    assert view.waiting.tenants() == {"a", "b"} and len(view.waiting) == 5
    assert [r.uid for r in view.waiting[1:3]] == [1, 2] and view.waiting[-1].uid == 4
    assert [r.uid for r in reversed(view.waiting)] == [4, 3, 2, 1, 0]
    assert view.waiting.index(view.waiting[3]) == 3 and view.waiting[3] in view.waiting
    assert [r.preemptions for r in view.waiting.window(3)] == [1, 1, 0]
    assert sched.abort(2) and sched.abort(1)
    view = sched.view()
    assert [r.uid for r in view.waiting.ordered("by prompt", lambda r: -r.uid)] == [4, 3, 0]
    assert [r.uid for r in view.waiting.of_tenant("b")] == [3]
    assert [r.uid for r in view.running] == []
    sched.check_invariants()
    while sched.has_work:
        sched.step()
    sched.check_invariants()


# ---- lpm ------------------------------------------------------------------------------------

def test_lpm_without_a_prefix_cache_is_first_come_first_served() -> None:
    for seed in range(3):
        assert trace(LongestPrefixMatch(), seed, "naive") == trace(PrefillFirst(), seed, "naive")


def admission_order(policy: Policy) -> tuple[list[int], int]:
    """One row. A runs while C1, W (sharing A's 12-token prefix) and C2 queue; W matches
    nothing when it arrives, A's pages are cached only as it finishes. The order the three
    were admitted in, and the tokens W found cached."""
    engine = FakeEngine(num_pages=64, page_size=4, max_rows=1, context_len=64)
    sched = Scheduler(engine, policy, EngineConfig(cache_type="radix", max_extend_tokens=64),
                      frozenset())
    shared = list(range(10, 22))
    sched.add_request(0, [*shared, 1, 2], SamplingParams(max_tokens=3))
    sched.step()
    for uid, prompt in ((1, [30, 31, 32, 33, 34]), (2, [*shared, 5, 6]), (3, [40, 41, 42])):
        sched.add_request(uid, prompt, SamplingParams(max_tokens=2))
    order: list[int] = []
    while sched.has_work:
        order += [e.uid for e in sched.step() if e.uid not in order and e.uid]
    sched.check_invariants()
    return order, sched.kv.stats.hit_tokens


def test_lpm_admits_the_request_the_cache_now_matches_before_earlier_cold_ones() -> None:
    assert admission_order(PrefillFirst()) == ([1, 2, 3], 12)
    assert admission_order(LongestPrefixMatch()) == ([2, 1, 3], 12)
    assert admission_order(LongestPrefixMatch(max_wait_rounds=0)) == ([1, 2, 3], 12)


def test_lpm_admits_a_cold_request_within_its_bound_under_a_stream_of_warm_ones() -> None:
    """Two warm requests arrive every round behind one cold one: lpm would pass it forever
    but for aging; it is admitted within max_wait_rounds + (A + 1) * (D + C + 1) rounds."""
    engine = FakeEngine(num_pages=128, page_size=4, max_rows=2, context_len=64)
    policy = LongestPrefixMatch(max_wait_rounds=5)
    sched = Scheduler(engine, policy, EngineConfig(cache_type="radix", max_extend_tokens=64),
                      frozenset())
    shared = list(range(10, 26))
    warm = SamplingParams(max_tokens=2)
    sched.add_request(0, [*shared, 1], warm)
    while sched.has_work:
        sched.step()  # the shared prefix is cached now
    uid, cold_admitted, arrived = 1, None, sched.round
    sched.add_request(1000, [40, 41, 42, 43, 44], SamplingParams(max_tokens=2))
    for _ in range(60):
        for _ in range(2):
            sched.add_request(uid, [*shared, uid % 40 + 1], warm)
            uid += 1
        events = sched.step()
        if cold_admitted is None and any(e.uid == 1000 for e in events):
            cold_admitted = sched.round
    assert cold_admitted is not None
    # A = 0 (the warm stream came after it), D = 2 tokens, C = 1 chunk.
    assert cold_admitted - arrived <= policy.max_wait_rounds + (0 + 1) * (2 + 1 + 1)
    assert cold_admitted - arrived > 1, "lpm should have passed it while it was young"
