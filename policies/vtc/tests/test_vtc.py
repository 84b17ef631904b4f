"""vtc on hand-built views, its discovery through asyncinfer's registry, and the paper's
bound on the service gap between backlogged tenants as a property of the real scheduler.

Needs the plugin installed: ``pip install -e policies/vtc --no-deps``; the property test
drives the scheduler with the repository's model-free engine (``tests/fake_engine.py``).
"""

from __future__ import annotations

import heapq
import random
from typing import Any

import pytest
from asyncinfer_vtc import VTC, service_bound
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.fake_engine import FakeEngine

from asyncinfer.config import EngineConfig
from asyncinfer.errors import ConfigError
from asyncinfer.params import SamplingParams
from asyncinfer.policies import (
    Decision,
    Policy,
    SchedulerView,
    TenantService,
    WaitingRequest,
    load_policy,
)
from asyncinfer.policies.registry import available_policies
from asyncinfer.scheduler.scheduler import Scheduler


def waiting(uid: int, tenant: str, prompt: int = 10, *, chunked: bool = False
            ) -> WaitingRequest:
    return WaitingRequest(uid=uid, prompt_len=prompt, prefill_remaining=prompt,
                          remaining_tokens=16, arrival_round=0, waited_rounds=0, chunked=chunked,
                          tenant=tenant)


def view(*wait: WaitingRequest, served: tuple[TenantService, ...] = (),
         free_slots: int = 8) -> SchedulerView:
    return SchedulerView(waiting=wait, running=(), free_pages=64, free_slots=free_slots,
                         token_budget=512, page_size=16, round=0, decode_streak=0,
                         served=served)


def test_the_tenant_served_least_goes_first_and_is_charged_as_it_is_listed() -> None:
    vtc = VTC(w_in=1, w_out=2)
    vtc.decide(view(waiting(1, "a"), waiting(2, "b")))  # both start waiting at 0
    served = (TenantService("a", 100, 10),)  # a got 120
    d = vtc.decide(view(waiting(3, "a", 50), waiting(4, "a", 50), waiting(5, "b", 30),
                        waiting(6, "b", 30), waiting(7, "b", 30), served=served))
    # b (0) takes 5 -> 30, 6 -> 60, 7 -> 90, all below a's 120; then a's in arrival order.
    assert d == Decision.prefill([5, 6, 7, 3, 4], "stop")
    assert vtc.counter("a") == 120 and vtc.counter("b") == 0


def test_ties_go_to_the_earlier_head_request() -> None:
    d = VTC().decide(view(waiting(9, "z"), waiting(4, "y"), waiting(6, "z")))
    assert d.candidates == (9, 4, 6)


def test_a_tenant_that_starts_waiting_is_lifted_to_the_lowest_waiting_counter() -> None:
    vtc = VTC(w_in=1, w_out=1)
    vtc.decide(view(waiting(1, "a"), waiting(2, "b")))
    vtc.decide(view(waiting(2, "b"), served=(TenantService("a", 0, 500),
                                            TenantService("b", 0, 300))))
    # c was idle: it starts at b's 300 (the only one still waiting), not at 0, and a
    # starting again keeps its higher 500.
    vtc.decide(view(waiting(2, "b"), waiting(3, "c"), waiting(4, "a")))
    assert (vtc.counter("a"), vtc.counter("b"), vtc.counter("c")) == (500, 300, 300)


def test_after_an_idle_spell_a_tenant_starts_at_the_last_floor() -> None:
    vtc = VTC(w_in=1, w_out=1)
    vtc.decide(view(waiting(1, "a")))
    vtc.decide(view(served=(TenantService("a", 40, 0),)))  # the queue is empty now
    vtc.decide(view(waiting(2, "b")))
    assert vtc.counter("b") == 0  # a's 40 came after the last view with anyone waiting
    vtc.decide(view(waiting(2, "b"), served=(TenantService("b", 70, 0),)))
    vtc.decide(view())
    vtc.decide(view(waiting(3, "new")))
    assert vtc.counter("new") == 70


def test_a_prefill_fills_the_free_slots_in_turn_without_listing_the_whole_queue() -> None:
    """Ten requests each from a, b, then c arrive together at four free rows: the rows go
    to a, b, c, then a again, and the candidates stop well short of the queue."""
    tenant = [("a", "b", "c")[i // 10] for i in range(30)]
    candidates = VTC().decide(view(*(waiting(i, tenant[i]) for i in range(30)),
                                   free_slots=4)).candidates
    assert candidates[:4] == (0, 10, 20, 1) and len(candidates) < 30
    sched = Scheduler(FakeEngine(num_pages=64, page_size=4, max_rows=4), VTC(), EngineConfig())
    for i in range(30):
        sched.add_request(i, [i + 1] * 10, SamplingParams(max_tokens=4, tenant=tenant[i]))
    sched.step()
    assert sorted(sched.running) == [0, 1, 10, 20]


def test_nothing_waiting_decodes() -> None:
    assert VTC().decide(view()) == Decision.decode()


def test_idle_tenants_are_forgotten_least_recently_served_first() -> None:
    vtc = VTC(max_tenants=2)
    vtc.decide(view(served=(TenantService("a", 1, 0),)))
    vtc.decide(view(served=(TenantService("b", 2, 0),)))
    vtc.decide(view(served=(TenantService("c", 3, 0),)))
    assert (vtc.counter("a"), vtc.counter("b"), vtc.counter("c")) == (0, 2, 3)


@pytest.mark.parametrize("options", [{"w_in": 0}, {"w_out": float("nan")}, {"w_in": True},
                                     {"max_tenants": 0}, {"w_out": "2"}])
def test_bad_options_are_refused_by_name(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=next(iter(options))):
        VTC(**options)


def test_found_through_its_entry_point() -> None:
    assert "vtc" in available_policies()
    policy = load_policy("vtc", {"w_out": 4})
    assert isinstance(policy, VTC) and isinstance(policy, Policy) and policy.w_out == 4


# ---- the bound, over random multi-tenant traffic ------------------------------------------

L_IN = 24
PAGES, PAGE_SIZE = 24, 4  # M: a KV cache of 96 tokens


@settings(max_examples=60, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 30),
                                   st.integers(1, L_IN), st.integers(1, 10)),
                         min_size=2, max_size=36),
       w_in=st.sampled_from([1.0, 0.5, 2.0]), w_out=st.sampled_from([1.0, 2.0, 4.0]),
       chunked=st.booleans(), seed=st.integers(0, 2**16))
def test_backlogged_tenants_get_service_within_the_bound(
        requests: list[tuple[int, int, int, int]], w_in: float, w_out: float, chunked: bool,
        seed: int) -> None:
    """Tenants (0-2) send requests at random rounds; whenever two both have requests
    waiting, over every stretch of such rounds the service each got differs by at most
    2 * max(w_in * L_in, w_out * M), measured from what the scheduler did (prompts when
    first admitted, tokens as they come), not from the policy's own counters."""
    engine = FakeEngine(num_pages=PAGES, page_size=PAGE_SIZE, max_rows=4, context_len=64)
    config = EngineConfig(max_extend_tokens=16 if chunked else 64, chunked_prefill=chunked)
    sched = Scheduler(engine, VTC(w_in=w_in, w_out=w_out), config)
    rng = random.Random(seed)
    tenant_of, prompt_of, arrivals = {}, {}, sorted(
        (at, uid, t, n, m) for uid, (t, at, n, m) in enumerate(requests))
    served: dict[int, float] = {0: 0.0, 1: 0.0, 2: 0.0}
    history: list[tuple[frozenset[int], dict[int, float]]] = []
    first_admitted: set[int] = set()
    rnd = 0
    while arrivals or sched.has_work:
        while arrivals and arrivals[0][0] <= rnd:
            _, uid, t, n, m = arrivals.pop(0)
            tenant_of[uid], prompt_of[uid] = t, n
            sched.add_request(uid, [rng.randrange(1, 50) for _ in range(n)],
                              SamplingParams(max_tokens=m, ignore_eos=True, tenant=str(t)))
        backlogged = frozenset(tenant_of[r.uid] for r in sched.waiting)
        for event in sched.step():
            if event.token is not None:
                served[tenant_of[event.uid]] += w_out
        for uid in tenant_of:
            if uid not in first_admitted and not any(
                    r.uid == uid and not r.admitted for r in sched.waiting):
                first_admitted.add(uid)
                served[tenant_of[uid]] += w_in * prompt_of[uid]
        history.append((backlogged, dict(served)))
        rnd += 1
        assert rnd < 2000, "the traffic should have been served by now"

    bound = service_bound(w_in, w_out, L_IN, PAGES * PAGE_SIZE)
    for f, g in [(0, 1), (0, 2), (1, 2)]:
        before = 0.0  # service gap before the current stretch of shared backlog
        gaps: list[float] | None = None
        for backlogged, totals in history:
            if {f, g} <= backlogged:
                gaps = [before] if gaps is None else gaps
                gaps.append(totals[f] - totals[g])
                assert max(gaps) - min(gaps) <= bound, (f, g, gaps, bound)
            else:
                gaps = None
            before = totals[f] - totals[g]


class _WholeQueueVTC(VTC):
    """vtc's picks over a copy of the whole queue, as before the view was lazy."""

    def _order(self, view: SchedulerView) -> list[int]:
        queues: dict[str, list[WaitingRequest]] = {}
        for req in view.waiting:
            queues.setdefault(req.tenant, []).append(req)
        limit = view.free_slots + sum(r.chunked for r in view.waiting) + 1
        position = {r.uid: i for i, r in enumerate(view.waiting)}
        heap = [(self._counters[t], position[q[0].uid], t) for t, q in queues.items()]
        heapq.heapify(heap)
        heads = dict.fromkeys(queues, 0)
        order: list[int] = []
        while heap and len(order) < limit:
            value, _, tenant = heapq.heappop(heap)
            queue, i = queues[tenant], heads[tenant]
            req = queue[i]
            order.append(req.uid)
            if not req.chunked and req.preemptions == 0:
                value += self.w_in * req.prompt_len
            heads[tenant] = i + 1
            if i + 1 < len(queue):
                heapq.heappush(heap, (value, position[queue[i + 1].uid], tenant))
        return order


def _batches(policy: VTC, seed: int) -> list[tuple[Any, ...]]:
    rng = random.Random(seed)
    engine = FakeEngine(num_pages=PAGES, page_size=PAGE_SIZE, max_rows=4, context_len=64)
    sched = Scheduler(engine, policy, EngineConfig(max_extend_tokens=16, chunked_prefill=True))
    out: list[tuple[Any, ...]] = []
    uid = 0
    for step in range(300):
        if step % 30 == 0:
            for _ in range(rng.randrange(10, 40)):
                sched.add_request(uid, [rng.randrange(1, 50) for _ in range(
                    rng.randrange(1, L_IN))], SamplingParams(
                        max_tokens=rng.randrange(1, 10), ignore_eos=True,
                        tenant=str(rng.randrange(4))))
                uid += 1
        events = sched.step()
        if sched.last_scheduled is not None:
            b = sched.last_scheduled.batch
            out.append((b.rows, b.starts, b.ends, [(e.uid, e.token) for e in events]))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_reading_one_head_per_tenant_gives_the_batches_of_reading_the_whole_queue(
        seed: int) -> None:
    assert _batches(VTC(), seed) == _batches(_WholeQueueVTC(), seed)
