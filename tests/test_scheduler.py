"""The scheduler under random arrivals, lengths, aborts, preemptions and failed batches,
driven with a fake engine whose KV pool runs short.

For every built-in policy and both cache types: budgets are never exceeded, pages are
conserved after every step, finished and aborted requests hold nothing, every request
finishes with the output it would have had alone (preempted and recovered ones too), a
suspect never shares a batch, and each policy keeps its fairness promise. Rows go out
lowest first, and a request moves between its row states only as documented.
"""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from asyncinfer.config import EngineConfig
from asyncinfer.errors import EngineError
from asyncinfer.params import SamplingParams
from asyncinfer.policies import view as policy_view
from asyncinfer.policies.base import Decision, Policy
from asyncinfer.policies.builtin import (
    DecodeFirst,
    LongestPrefixMatch,
    PrefillFirst,
    Priority,
    SkipAhead,
)
from asyncinfer.scheduler.request import Req, RowState
from asyncinfer.scheduler.scheduler import ScheduledBatch, Scheduler
from asyncinfer.scheduler.table import RowTable
from tests.fake_engine import EOS, FakeEngine, reference_output

PREFIXES = [[], [5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 20, 21, 22, 23, 24, 25]]
BUDGET = 24
MAX_TOKENS = 24
CONTEXT = 64        # the longest prompt (40) plus MAX_TOKENS: nothing is clamped
# KV pressure: the pool holds one longest request, or three short ones, never four rows'
# worth; admission must hold back pages for what running requests may still produce.
POOL_TOKENS = 64


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, aborts and steps; the checks run after every step."""

    policy: Policy
    uids = Bundle("uids")

    @initialize(cache_type=st.sampled_from(["radix", "naive"]), chunked=st.booleans(),
                page_size=st.sampled_from([1, 4]), overlap=st.booleans())
    def setup(self, cache_type: str, chunked: bool, page_size: int, overlap: bool) -> None:
        # With overlap, batch N+1 is scheduled (and computed) before N's results are seen.
        self.overlap = overlap
        self.inflight: tuple[ScheduledBatch, list[int]] | None = None
        self.engine = FakeEngine(num_pages=POOL_TOKENS // page_size, page_size=page_size,
                                 max_rows=4, context_len=CONTEXT, eos_every=13)
        self.config = EngineConfig(cache_type=cache_type,  # type: ignore[arg-type]
                                   max_extend_tokens=BUDGET if chunked else CONTEXT,
                                   chunked_prefill=chunked)
        self.sched = Scheduler(self.engine, self.policy, self.config, frozenset({EOS}))
        self.next_uid = 0
        self.expected: dict[int, list[int]] = {}
        self.outputs: dict[int, list[int]] = {}
        self.finished: dict[int, str] = {}
        self.arrived: dict[int, int] = {}       # uid -> round of arrival
        self.admitted: dict[int, int] = {}      # uid -> round of first admission
        self.unfinished_before: dict[int, int] = {}
        self.decode_streak = 0
        self.disturbed = False                  # a preemption or a failure happened

    @rule(target=uids, prefix=st.sampled_from(PREFIXES),
          suffix=st.lists(st.integers(1, 49), min_size=1, max_size=30),
          max_tokens=st.integers(1, MAX_TOKENS), ignore_eos=st.booleans(),
          priority=st.integers(0, 3))
    def arrive(self, prefix: list[int], suffix: list[int], max_tokens: int,
               ignore_eos: bool, priority: int) -> int:
        uid, self.next_uid = self.next_uid, self.next_uid + 1
        prompt = prefix + suffix
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos,
                                priority=priority)
        self.sched.add_request(uid, prompt, params)
        self.expected[uid] = reference_output(prompt, max_tokens, self.engine.vocab,
                                              self.engine.eos_every, ignore_eos)
        self.arrived[uid] = self.sched.round
        self.unfinished_before[uid] = sum(1 for u in self.arrived if u not in self.finished) - 1
        return uid

    @rule(uid=consumes(uids))
    def abort(self, uid: int) -> None:
        if uid not in self.finished:
            assert self.sched.abort(uid)

    @rule(uid=uids)
    def preempt(self, uid: int) -> None:
        # With overlap a batch holding it may be in flight: its result must be dropped.
        if self.sched.preempt(uid):
            self.disturbed = True

    @rule(which=st.sampled_from(["in flight", "next"]))
    def fail_a_batch(self, which: str) -> None:
        """A forward raises: the batch in flight (the next one launched after it, as the
        coordinator does), or the next batch scheduled."""
        sched = self.sched
        if which == "next" and self.inflight is not None:
            sched.process(*self.inflight)
            self.inflight = None
        self._record(sched.take_events())
        failed = self.inflight[0] if self.inflight is not None else sched.schedule()
        later = sched.schedule() if self.inflight is not None else None
        self.inflight = None
        if failed is None:
            return
        # Not those aborted, or preempted, since it was launched.
        suspects = [r.uid for r in sched._members(failed)]
        sched.recover(failed, later, "injected")
        sched.flush()
        self.disturbed = True
        events = sched.take_events()
        if failed.batch.size == 1:
            assert [(e.uid, e.finish_reason, e.error_kind) for e in events] == [
                (u, "error", "engine") for u in suspects]
        else:
            assert not events and all(u in sched._suspects for u in suspects)
        self._record(events)

    @rule()
    def step(self) -> None:
        sched = self.sched
        waiting_fresh = [r.uid for r in sched.waiting if not r.admitted]
        resumed = {r.uid for r in sched.waiting if r.admitted}
        suspects = set(sched._suspects)
        waiting_suspects = {r.uid for r in sched.waiting if r.suspect}
        streak_before = sched.decode_streak
        waited_before = bool(sched.waiting)
        round_before = sched.round
        batches_before = len(self.engine.batches)
        events = self._advance()
        if len(self.engine.batches) > batches_before:
            batch = self.engine.batches[-1]
            assert batch.size <= self.engine.max_rows
            if batch.phase == "prefill" or any(not s for s in batch.sample):
                assert batch.num_tokens <= self.config.max_extend_tokens
            uids = [r.uid for r in _scheduled_reqs(sched, batch)]
            new = [u for u in uids if u not in resumed and u in waiting_fresh]
            for u in new:
                self.admitted.setdefault(u, round_before)
            if any(u in suspects for u in uids):
                assert len(uids) == 1, f"a suspect shares batch {uids}"
            if waiting_suspects:  # a waiting suspect goes alone, or the others decode
                assert (uids[0] in waiting_suspects and len(uids) == 1) or (
                    batch.phase == "decode" and not suspects & set(uids))
            else:
                self._check_fairness(batch, new, waiting_fresh, streak_before, waited_before)
        self._record(events)

    def _advance(self):  # type: ignore[no-untyped-def]
        sched = self.sched
        if not self.overlap:
            return sched.step()
        scheduled = sched.schedule()
        launched = None
        if scheduled is not None:
            launched = (scheduled, self.engine.forward(scheduled.batch).next_tokens.tolist())
        if self.inflight is not None:
            sched.process(*self.inflight)
        self.inflight = launched
        sched.flush()
        return sched.take_events()

    def _check_fairness(self, batch, new, waiting_fresh, streak, waited) -> None:  # type: ignore[no-untyped-def]
        if isinstance(self.policy, PrefillFirst) and new:
            assert new == waiting_fresh[: len(new)], "prefill_first admitted out of order"
        if (isinstance(self.policy, DecodeFirst) and batch.phase == "decode" and waited
                and streak >= self.policy.max_decode_rounds):
            # Past the cap the policy must ask for prefill; decoding anyway means the
            # scheduler found nothing admissible.
            decision = self.sched.last_decision
            assert decision is not None and decision.action == "prefill"

    def _record(self, events) -> None:  # type: ignore[no-untyped-def]
        for event in events:
            assert event.uid not in self.finished, "event after finish"
            if event.token is not None:
                self.outputs.setdefault(event.uid, []).append(event.token)
            if event.finished:
                self.finished[event.uid] = event.finish_reason

    @invariant()
    def resources_are_conserved(self) -> None:
        if hasattr(self, "sched"):
            self.sched.check_invariants()

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):
            if not self.sched.has_work and self.inflight is None:
                break
            self.step()
        assert not self.sched.has_work, "requests left unfinished"
        self.sched.check_invariants()
        assert self.sched.kv.allocator.num_free + self.sched.kv.cached_pages == (
            self.engine.num_pages)
        assert len(self.sched.free_rows) == self.engine.max_rows
        assert set(self.finished) == set(self.expected), "a request never finished"
        for uid, reason in self.finished.items():
            if reason in ("length", "stop"):
                assert self.outputs[uid] == self.expected[uid], f"request {uid} output differs"
        # Preempted requests jump the queue, and suspects the policy: no bound holds then.
        if isinstance(self.policy, (SkipAhead, LongestPrefixMatch)) and not self.disturbed:
            chunks = math.ceil(CONTEXT / BUDGET)
            for uid, admitted in self.admitted.items():
                bound = self.policy.old_after + (self.unfinished_before[uid] + 1) * (
                    MAX_TOKENS + chunks + 1)
                assert admitted - self.arrived[uid] <= bound, (uid, admitted, bound)


def _scheduled_reqs(sched: Scheduler, batch):  # type: ignore[no-untyped-def]
    return sched.last_scheduled.reqs


def _machine(policy: Policy) -> type[SchedulerMachine]:
    return type(f"Machine_{policy.name}", (SchedulerMachine,), {"policy": policy})


# Derandomized: the same examples every run, so its time and its verdict do not vary.
SETTINGS = settings(max_examples=40, stateful_step_count=60, deadline=None,
                    derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("policy", [
    PrefillFirst(), DecodeFirst(max_decode_rounds=2), DecodeFirst(max_decode_rounds=1),
    SkipAhead(aging=1.0, threshold=6.0), SkipAhead(aging=0.5, threshold=3.0),
    Priority(), Priority(aging=0.0), Priority(aging=1.0, preempt=False),
    LongestPrefixMatch(max_wait_rounds=6), LongestPrefixMatch(max_wait_rounds=2),
], ids=lambda p: f"{p.name}")
def test_scheduler_invariants_hold_under_random_traffic(policy: Policy) -> None:
    machine = _machine(policy)
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()


def test_skip_ahead_keeps_its_bound_when_it_offers_only_as_many_as_rows_are_free(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The skipping window at its smallest: young requests beyond the free rows are not
    offered, yet once a request is old it and everything older come first, so the bound
    checked at teardown holds whatever the window."""
    monkeypatch.setattr(policy_view, "SKIP_WINDOW", 0)
    machine = _machine(SkipAhead(aging=1.0, threshold=6.0))
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()


def test_a_request_waits_for_the_pages_running_requests_may_still_need() -> None:
    """Two requests that each may grow to 12 of the pool's 16 pages: the second is held back
    until the first has finished, though its prompt fits at once, and neither runs dry."""
    engine = FakeEngine(num_pages=16, page_size=4, max_rows=4, context_len=64)
    sched = Scheduler(engine, PrefillFirst(), EngineConfig(cache_type="naive"), frozenset())
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]
    for uid, prompt in enumerate(prompts):
        sched.add_request(uid, prompt, SamplingParams(max_tokens=40, temperature=0.0))
    outputs: dict[int, list[int]] = {0: [], 1: []}
    order: list[tuple[int, bool]] = []          # (uid, finished) per event
    while sched.has_work:
        for event in sched.step():
            if event.token is not None:
                outputs[event.uid].append(event.token)
            order.append((event.uid, event.finished))
    first_of_1 = order.index((1, False))
    assert order[first_of_1 - 1] == (0, True), "admitted only once the first had finished"
    for uid, prompt in enumerate(prompts):
        assert outputs[uid] == reference_output(prompt, 40, engine.vocab), uid
    sched.check_invariants()


class _DecodeOnly:
    """A broken policy: it never admits anything."""

    name = "decode_only"

    def decide(self, view):  # type: ignore[no-untyped-def]
        return Decision.decode()


def test_a_policy_that_never_admits_is_a_clear_error_not_a_hang() -> None:
    engine = FakeEngine()
    sched = Scheduler(engine, _DecodeOnly(), EngineConfig(), frozenset())
    sched.add_request(0, [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(EngineError, match=r"decode_only.*admitted nothing"):
        sched.step()


def test_rows_go_out_lowest_first_whatever_the_release_order() -> None:
    table = RowTable(4)
    assert [table.allocate() for _ in range(4)] == [0, 1, 2, 3]
    for row in (2, 0, 3):
        table.release(row)
    assert (table.free_rows, table.num_free) == ([0, 2, 3], 3)
    assert table.allocate() == 0
    with pytest.raises(AssertionError, match="released twice"):
        table.release(2)


def test_a_request_moves_through_its_row_states_in_order() -> None:
    req = Req(0, [1, 2, 3], SamplingParams(), max_tokens=4, arrival_round=0)
    assert (req.row, req.row_state, req.admitted) == (None, RowState.NONE, False)
    with pytest.raises(AssertionError, match="unclaimed"):
        req.take_row(1)
    req.claim_row()
    assert (req.row, req.row_state, req.admitted) == (None, RowState.CLAIMED, False)
    req.take_row(5)
    assert (req.row, req.row_state, req.admitted) == (5, RowState.HELD, True)
    assert req.drop_row() == 5
    assert (req.row, req.row_state, req.admitted) == (None, RowState.NONE, False)
    with pytest.raises(AssertionError, match="holds no row"):
        req.drop_row()


@pytest.mark.parametrize("cache_type", ["naive", "radix"])
def test_prefix_lookups_are_counted_only_by_a_cache_that_shares(cache_type: str) -> None:
    engine = FakeEngine(page_size=4)
    config = EngineConfig(cache_type=cache_type)  # type: ignore[arg-type]
    sched = Scheduler(engine, PrefillFirst(), config, frozenset())
    prompt = list(range(1, 14))
    for uid in range(2):  # the second finds the first's three full prompt pages cached
        sched.add_request(uid, prompt, SamplingParams(max_tokens=2, temperature=0.0))
        while sched.has_work:
            sched.step()
    stats = sched.kv.stats
    counts = (stats.queries, stats.hits, stats.query_tokens, stats.hit_tokens)
    assert counts == ((2, 1, 26, 12) if cache_type == "radix" else (0, 0, 0, 0))
    sched.check_invariants()


def test_a_high_priority_request_preempts_its_way_in_and_the_preempted_lose_nothing() -> None:
    """Both request slots run low-priority requests when a high-priority one arrives: it is
    admitted in the next round (the policy's stated bound), the worse of the two running is
    preempted, and every request, the preempted one included, ends with exactly the tokens
    it produces alone. Its prompt's full pages were kept in the prefix cache."""
    engine = FakeEngine(num_pages=64, page_size=4, max_rows=2, context_len=256)
    sched = Scheduler(engine, Priority(), EngineConfig(max_extend_tokens=64), frozenset())
    low = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27]]
    sched.add_request(0, low[0], SamplingParams(max_tokens=30, temperature=0.0, priority=5))
    sched.add_request(1, low[1], SamplingParams(max_tokens=30, temperature=0.0, priority=3))
    outputs: dict[int, list[int]] = {}

    def step() -> None:
        for event in sched.step():
            if event.token is not None:
                outputs.setdefault(event.uid, []).append(event.token)

    for _ in range(4):
        step()
    assert set(sched.running) == {0, 1}
    high = [30, 31, 32, 33, 34]
    sched.add_request(2, high, SamplingParams(max_tokens=6, temperature=0.0, priority=0))
    step()
    assert sched.last_decision is not None and sched.last_decision.preempt == (0,)
    assert 2 in sched.running and 0 not in sched.running, "admitted in the next round"
    assert sched.kv.cached_pages >= len(low[0]) // 4, "its full pages stayed cached"
    for _ in range(200):
        if not sched.has_work:
            break
        step()
    for uid, prompt, n in ((0, low[0], 30), (1, low[1], 30), (2, high, 6)):
        assert outputs[uid] == reference_output(prompt, n, engine.vocab), uid
    sched.check_invariants()


def test_equal_priorities_never_preempt_each_other() -> None:
    from asyncinfer.policies.base import RunningRequest, SchedulerView, WaitingRequest

    view = SchedulerView(
        waiting=(WaitingRequest(9, 8, 8, 4, 3, 1, False, priority=1),),
        running=(RunningRequest(1, 20, 4, priority=1), RunningRequest(2, 20, 4, priority=2)),
        free_pages=0, free_slots=0, token_budget=64, page_size=4, round=4, decode_streak=0)
    assert Priority().decide(view).preempt == (2,)
    same = attrs.evolve(view, running=(RunningRequest(1, 20, 4, priority=1),))
    assert Priority().decide(same).preempt == ()
    assert Priority(preempt=False).decide(view).preempt == ()
