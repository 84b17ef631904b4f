"""The scheduler under random arrivals, lengths, aborts, preemptions and failed batches,
driven with a fake engine whose KV pool runs short.

For every built-in policy, and a random policy of mixed decisions, and both cache types:
budgets (decode tokens counted in mixed batches) are never exceeded, pages are
conserved after every step, finished and aborted requests hold nothing, every request
finishes with the output it would have had alone (preempted and recovered ones too), a
suspect never shares a batch, and each policy keeps its fairness promise. Rows go out
lowest first, and a request moves between its row states only as documented.
"""

from __future__ import annotations

import math
import random

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
    StallFree,
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
        decision_before = sched.last_decision
        running_before = set(sched.running)
        due = {r.uid for r in sched.running.values() if r.device_len < r.max_len and not r.suspect}
        events = self._advance()
        if isinstance(self.policy, StallFree) and due and not waiting_suspects:
            # No stall: every running request with a token to compute decodes this round.
            assert len(self.engine.batches) > batches_before
            stalled = due - {r.uid for r in sched.last_scheduled.reqs}
            assert not stalled, f"running requests {stalled} left out of a round"
        if len(self.engine.batches) > batches_before:
            batch = self.engine.batches[-1]
            assert batch.size <= self.engine.max_rows
            if batch.phase == "prefill" or any(not s for s in batch.sample):
                assert batch.num_tokens <= self.config.max_extend_tokens
            reqs = _scheduled_reqs(sched, batch)
            for req, end, sampled in zip(reqs, batch.ends, batch.sample):
                assert not sampled or end < req.max_len, "sampled past its max tokens"
            if sched.last_decision is not decision_before:  # the policy decided this round
                self._check_decision(sched.last_decision, reqs, batch, running_before)
            uids = [r.uid for r in reqs]
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

    def _check_decision(self, decision, reqs, batch, running_before) -> None:  # type: ignore[no-untyped-def]
        """A mixed batch decodes only the chosen running requests, one token each, and its
        prefill tokens fit in what the decodes left of the round's budget."""
        if decision is None or decision.action != "mixed":
            return
        decoded = [r.uid for r in reqs  # not a preempted one, prefilling again
                   if r.uid in running_before and r.uid not in decision.preempt]
        prefilled = len(decoded) < len(reqs)
        if decision.decoding is not None and prefilled:  # else maybe the fallback decode
            assert set(decoded) <= set(decision.decoding), (decoded, decision.decoding)
        limit = self.config.max_extend_tokens
        if decision.token_budget is not None:
            limit = min(limit, decision.token_budget)
        lens = dict(zip([r.uid for r in reqs], batch.extend_lens))
        assert all(lens[u] == 1 for u in decoded)
        prefill_tokens = batch.num_tokens - len(decoded)
        assert prefill_tokens <= max(0, limit - len(decoded)), (prefill_tokens, limit, decoded)

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
        if isinstance(self.policy, StallFree) and not self.disturbed:
            rows, limit = self.engine.max_rows, self.config.max_extend_tokens
            budget = min(self.policy.token_budget or limit, limit)
            chunks = math.ceil(40 / (budget - rows + 1)) if self.config.chunked_prefill else 1
            for uid, admitted in self.admitted.items():
                bound = (self.unfinished_before[uid] + 1) * (chunks + MAX_TOKENS + 1)
                assert admitted - self.arrived[uid] <= bound, (uid, admitted, bound)
        if isinstance(self.policy, (SkipAhead, LongestPrefixMatch)) and not self.disturbed:
            chunks = math.ceil(CONTEXT / BUDGET)
            for uid, admitted in self.admitted.items():
                bound = self.policy.old_after + (self.unfinished_before[uid] + 1) * (
                    MAX_TOKENS + chunks + 1)
                assert admitted - self.arrived[uid] <= bound, (uid, admitted, bound)


def _scheduled_reqs(sched: Scheduler, batch):  # type: ignore[no-untyped-def]
    return sched.last_scheduled.reqs


@attrs.frozen
class RandomMixed:
    """Random decisions, mostly mixed: all or some running requests decode, the waiting ones
    in a shuffled order, stop or skip, at times a smaller budget or a preemption. Drawn from
    the round, so the same views give the same decisions."""

    seed: int = 0
    name = "random_mixed"

    def decide(self, view):  # type: ignore[no-untyped-def]
        rng = random.Random(view.round * 7919 + self.seed)
        waiting = [r.uid for r in view.waiting]
        running = [r.uid for r in view.running]
        rng.shuffle(waiting)
        kind = rng.random()
        if kind < 0.1 and running:
            return Decision.decode()
        if kind < 0.2:
            return Decision.prefill(waiting, rng.choice(["stop", "skip"]))
        decode = None if rng.random() < 0.5 else rng.sample(running, rng.randint(0, len(running)))
        preempt = rng.sample(running, 1) if running and rng.random() < 0.05 else ()
        budget = None if rng.random() < 0.5 else rng.randint(1, 2 * BUDGET)
        offered = waiting[: rng.randint(0, len(waiting))] if rng.random() < 0.2 else waiting
        if not running:  # the contract: offer every waiting request to an idle engine
            offered, budget = waiting, None
        offered = [*offered, *preempt]  # and what it preempts, which may leave it idle
        return Decision.mixed(offered, rng.choice(["stop", "skip"]), decode=decode,
                              preempt=preempt, token_budget=budget)


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
    RandomMixed(0), RandomMixed(1), StallFree(), StallFree(token_budget=10),
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


def test_a_failed_mixed_batch_recovers_its_members_alone_with_their_tokens() -> None:
    """Under stall_free a decoding request and a new prompt share a batch whose forward
    fails: both become suspects, each next runs alone (the other waits), and both end with
    the tokens they produce alone."""
    engine = FakeEngine(num_pages=64, page_size=4, max_rows=4, context_len=128)
    sched = Scheduler(engine, StallFree(), EngineConfig(max_extend_tokens=16), frozenset())
    prompts = {0: [5, 6, 7, 8, 9], 1: list(range(10, 40))}
    outputs: dict[int, list[int]] = {0: [], 1: []}

    def record(events) -> None:  # type: ignore[no-untyped-def]
        for event in events:
            if event.token is not None:
                outputs[event.uid].append(event.token)

    sched.add_request(0, prompts[0], SamplingParams(max_tokens=12, temperature=0.0))
    record(sched.step())
    sched.add_request(1, prompts[1], SamplingParams(max_tokens=6, temperature=0.0))
    failed = sched.schedule()
    assert failed is not None and failed.phase == "mixed"
    assert [r.uid for r in failed.reqs] == [0, 1] and failed.batch.num_tokens == 16
    sched.recover(failed, None, "injected")
    assert sched._suspects == {0, 1} and not sched.take_events()
    alone = []
    while sched.has_work:
        before = len(engine.batches)
        record(sched.step())
        if sched._suspects and len(engine.batches) > before:
            alone.append([r.uid for r in sched.last_scheduled.reqs])
    assert alone and all(len(uids) == 1 for uids in alone)
    for uid, n in ((0, 12), (1, 6)):
        assert outputs[uid] == reference_output(prompts[uid], n, engine.vocab), uid
    sched.check_invariants()
