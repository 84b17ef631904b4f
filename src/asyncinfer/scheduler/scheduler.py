"""The scheduler: receive → select (by policy) → prepare → forward → process.

One loop serves the offline ``LLM`` and the online coordinator. It keeps the waiting queue
(arrival order), the running set (iterated in uid order: set order differs between ranks),
the request table and the KV cache, and asks a Policy what runs next.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from attrs import define

from asyncinfer.config import EngineConfig
from asyncinfer.engine.batch import Batch
from asyncinfer.errors import EngineError
from asyncinfer.params import SamplingParams
from asyncinfer.policies.base import (
    Decision,
    Policy,
    RunningRequest,
    SchedulerView,
    WaitingRequest,
)
from asyncinfer.scheduler.cache import CacheManager
from asyncinfer.scheduler.engine import Engine
from asyncinfer.scheduler.prefill import PrefillAdder
from asyncinfer.scheduler.request import Event, FinishReason, Req

logger = logging.getLogger(__name__)


@define
class ScheduledBatch:
    """A batch with the requests behind it and the extents each computes."""

    batch: Batch
    reqs: list[Req]
    phase: str
    seq: int = 0      # 1, 2, ... in launch order


class Scheduler:
    """Continuous batching over a paged KV cache, with batch selection left to a Policy."""

    def __init__(self, engine: Engine, policy: Policy, config: EngineConfig,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.engine = engine
        self.policy = policy
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.cache = CacheManager(engine.num_pages, engine.page_size, engine.page_table,
                                  config.cache_type)
        self.waiting: list[Req] = []            # arrival order
        self.running: dict[int, Req] = {}       # uid -> request, decoding
        self.free_rows = list(range(engine.max_rows))
        self.round = 0
        self.decode_streak = 0
        self.tokens_computed = 0
        self.last_decision: Decision | None = None
        self.last_scheduled: ScheduledBatch | None = None
        self._events: list[Event] = []
        self._launched = 0                      # batches scheduled so far
        self._processed = 0                     # batches whose results were processed
        # Finished or aborted requests whose row and pages a launched batch may still touch,
        # with the batch they wait for: with overlap, batch N+1 runs while N is processed.
        self._deferred: list[tuple[int, Req, bool]] = []

    # ---- receive -------------------------------------------------------------------------

    def add_request(self, uid: int, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Queue a request; one that can never run finishes at once with an error event."""
        n, ctx = len(prompt_ids), self.engine.context_len
        capacity = self.engine.num_pages * self.engine.page_size
        error = None
        if n == 0:
            error = "the prompt is empty"
        elif n >= ctx:
            error = (f"the prompt has {n} tokens but the context holds {ctx} "
                     "(prompt and at least one output token)")
        elif n >= capacity:
            error = f"the prompt has {n} tokens but the KV cache holds only {capacity}"
        elif n > self.config.max_extend_tokens and not self.config.chunked_prefill:
            error = (f"the prompt has {n} tokens, more than max_extend_tokens="
                     f"{self.config.max_extend_tokens}, and chunked prefill is off")
        if error is not None:
            self._events.append(Event(uid, None, "error", error))
            return
        max_tokens = min(params.max_tokens, ctx - n, capacity - n)
        self.waiting.append(Req(uid, list(prompt_ids), params, max_tokens, self.round))

    def abort(self, uid: int, notify: bool = True) -> bool:
        """Drop a request wherever it is and free what it holds; False if unknown.

        With ``notify`` an "abort" event reports it; a frontend that ended the request
        itself (a stop string matched) passes False.
        """
        index = next((i for i, r in enumerate(self.waiting) if r.uid == uid), None)
        if index is not None:
            req = self.waiting.pop(index)
        elif uid in self.running:
            req = self.running.pop(uid)
        else:
            return False
        req.finished = True
        if req.admitted:
            self._release(req, keep=False)
        if notify:
            self._events.append(Event(uid, None, "abort"))
        return True

    @property
    def has_work(self) -> bool:
        """Something is waiting, running, releasing, or has an event to report."""
        return bool(self.waiting or self.running or self._events or self._deferred)

    @property
    def in_flight(self) -> int:
        """Batches launched whose results have not been processed yet."""
        return self._launched - self._processed

    # ---- select and prepare ----------------------------------------------------------------

    def view(self) -> SchedulerView:
        """The read-only snapshot a policy decides from."""
        reserved = self._reserved_pages()
        return SchedulerView(
            waiting=tuple(
                WaitingRequest(r.uid, r.prompt_len, r.prompt_len - r.cached_len, r.max_tokens,
                               r.arrival_round, self.round - r.arrival_round, r.admitted)
                for r in self.waiting),
            running=tuple(RunningRequest(r.uid, r.seq_len, r.remaining_tokens)
                          for r in self._running_in_uid_order()),
            free_pages=max(0, self.cache.available_pages - reserved),
            free_slots=len(self.free_rows),
            token_budget=self.config.max_extend_tokens,
            page_size=self.engine.page_size,
            round=self.round,
            decode_streak=self.decode_streak,
        )

    def schedule(self) -> ScheduledBatch | None:
        """Ask the policy, then build the batch it chose (or the fallback decode).

        None when there is nothing to run until a batch in flight is processed.
        """
        if not (self.waiting or self.running):
            return None
        decision = self.last_decision = self.policy.decide(self.view())
        batch = None
        if decision.action == "prefill":
            batch = self._schedule_prefill(decision)
        if batch is None:
            batch = self._schedule_decode()
        if batch is None:
            if self.in_flight == 0 and not self.running and not self._deferred:
                # Nothing runs and nothing will be freed: waiting again would hang.
                raise EngineError(
                    f"policy {self.policy.name!r} admitted nothing into an idle engine "
                    f"(decision {decision.action}, candidates "
                    f"{list(decision.candidates)[:8]}); a policy must offer a waiting "
                    "request when nothing is running")
            return None
        self._launched += 1
        batch.seq = self._launched
        self.decode_streak = self.decode_streak + 1 if batch.phase == "decode" else 0
        self.last_scheduled = batch
        return batch

    def _schedule_prefill(self, decision: Decision) -> ScheduledBatch | None:
        by_uid = {r.uid: r for r in self.waiting}
        adder = PrefillAdder(self.cache, self.config.max_extend_tokens, len(self.free_rows),
                             self._reserved_pages(), self.config.chunked_prefill)
        # A half-prefilled prompt holds pages and a row: resume it before anything else.
        order = [r.uid for r in self.waiting if r.admitted]
        order += [u for u in decision.candidates if u in by_uid and not by_uid[u].admitted]
        for uid in order:
            if not adder.try_add(by_uid[uid]) and decision.on_misfit == "stop":
                break
        if not adder.admitted:
            return None
        for req, end in adder.admitted:
            if req.row == -2:
                req.row = self.free_rows.pop(0)
                self.engine.write_prompt(req.row, req.prompt_ids)
                self.cache.map_prefix(req)
            self.cache.allocate(req, end)
        reqs = [req for req, _ in adder.admitted]
        ends = [end for _, end in adder.admitted]
        batch = Batch(rows=[r.row for r in reqs], starts=[r.cached_len for r in reqs],
                      ends=ends, params=[r.params for r in reqs],
                      steps=[0] * len(reqs),
                      sample=[e == r.prompt_len for r, e in zip(reqs, ends)])
        for req, end in adder.admitted:
            req.cached_len = end
            if end == req.prompt_len:  # its first token is on the way: it decodes from now on
                req.device_len = end + 1
                self.waiting.remove(req)
                self.running[req.uid] = req
        return ScheduledBatch(batch, reqs, "prefill")

    def _schedule_decode(self) -> ScheduledBatch | None:
        # A request whose last token is already launched has nothing left to decode.
        reqs = [r for r in self._running_in_uid_order() if r.device_len < r.max_len]
        if not reqs:
            return None
        size = self.engine.page_size
        for req in reqs:
            if req.device_len > len(req.pages) * size:  # crosses into a new page
                self.cache.allocate(req, req.device_len)
        batch = Batch(rows=[r.row for r in reqs], starts=[r.device_len - 1 for r in reqs],
                      ends=[r.device_len for r in reqs], params=[r.params for r in reqs],
                      steps=[r.device_len - r.prompt_len for r in reqs])
        for req in reqs:
            req.cached_len = req.device_len
            req.device_len += 1
        return ScheduledBatch(batch, reqs, "decode")

    # ---- forward and process ---------------------------------------------------------------

    def step(self) -> list[Event]:
        """One round without overlap: schedule, run the batch, process its results."""
        scheduled = self.schedule()
        if scheduled is not None:
            tokens = self.engine.forward(scheduled.batch).next_tokens.tolist()
            self.process(scheduled, tokens)
        return self.take_events()

    def take_events(self) -> list[Event]:
        """Events produced since the last call, in order."""
        events, self._events = self._events, []
        return events

    def process(self, scheduled: ScheduledBatch, tokens: list[int]) -> None:
        """Hand each request its token, finish those that are done, free what may be freed.

        Batches must be processed in launch order.
        """
        assert scheduled.seq == self._processed + 1, "batches processed out of order"
        self._processed = scheduled.seq
        self.round += 1
        self.tokens_computed += scheduled.batch.num_tokens
        self._release_deferred()
        for req, sampled, token in zip(scheduled.reqs, scheduled.batch.sample, tokens):
            if not sampled or req.finished:  # a mid-prompt chunk, or a result nobody awaits
                continue
            req.output_ids.append(token)
            reason: FinishReason | None = None
            if token in self.eos_token_ids and not req.params.ignore_eos:
                reason = "stop"
            elif req.remaining_tokens <= 0:
                reason = "length"
            self._events.append(Event(req.uid, token, reason, prefix_len=req.prefix_len))
            if reason is not None:
                req.finished = True
                del self.running[req.uid]
                self._release(req, keep=True)

    # ---- bookkeeping -----------------------------------------------------------------------

    def _running_in_uid_order(self) -> list[Req]:
        return [self.running[uid] for uid in sorted(self.running)]

    def _reserved_pages(self) -> int:
        # Called every round over every active request: plain arithmetic, no properties.
        size = self.engine.page_size
        active = list(self.running.values()) + [r for r in self.waiting if r.admitted]
        return sum((len(r.prompt_ids) + r.max_tokens + size - 1) // size - len(r.pages)
                   for r in active)

    def _release(self, req: Req, keep: bool) -> None:
        if self.in_flight:  # a launched batch may still read or write its row and pages
            self._deferred.append((self._launched, req, keep))
            return
        self.cache.release(req, keep)
        self.free_rows.append(req.row)
        self.free_rows.sort()
        req.row = -1

    def _release_deferred(self) -> None:
        waiting = []
        for batch_seq, req, keep in self._deferred:
            if batch_seq > self._processed:
                waiting.append((batch_seq, req, keep))
                continue
            self.cache.release(req, keep)
            self.free_rows.append(req.row)
            req.row = -1
        self.free_rows.sort()
        self._deferred = waiting

    def abort_all(self) -> None:
        """Drop every request after a failed round; launched batches count as done (the
        caller waited for them to stop running)."""
        self._processed = self._launched
        for uid in [r.uid for r in self.waiting] + list(self.running):
            self.abort(uid, notify=False)
        self._release_deferred()

    def flush(self) -> None:
        """Release what finished requests hold once no batch is in flight."""
        if self.in_flight == 0:
            self._release_deferred()

    def check_invariants(self) -> None:
        """Every page is free, cached or owned by exactly one active request; rows likewise."""
        active = list(self.running.values()) + [r for r in self.waiting if r.admitted]
        active += [req for _, req, _ in self._deferred]
        owned = sum(len(r.pages) - r.shared_pages for r in active)
        free, cached = self.cache.allocator.num_free, self.cache.cached_pages
        assert free + cached + owned == self.engine.num_pages, (free, cached, owned)
        rows = sorted([r.row for r in active] + self.free_rows)
        assert rows == list(range(self.engine.max_rows)), rows
        assert self._reserved_pages() <= self.cache.available_pages
