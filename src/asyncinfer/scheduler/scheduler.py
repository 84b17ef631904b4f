"""The scheduler: receive, select (by policy), prepare, forward, process.
See docs/architecture.md, 'Scheduler'."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

from attrs import define, evolve

from asyncinfer.config import EngineConfig
from asyncinfer.core import Batch, Event, FinishReason, TopLogprobs
from asyncinfer.errors import EngineError
from asyncinfer.params import SamplingParams
from asyncinfer.policies.base import (
    Decision,
    Policy,
    SchedulerView,
    TenantService,
    WaitingRequest,
)
from asyncinfer.scheduler.batch_runner import BatchRunner
from asyncinfer.scheduler.kv_manager import KVManager
from asyncinfer.scheduler.prefill import PrefillAdder
from asyncinfer.scheduler.queue import LiveRunning, LiveWaiting, RunningSet, WaitingQueue
from asyncinfer.scheduler.request import Req, RowState
from asyncinfer.scheduler.scoring import gather_scores, sampled_logprobs, scored_counts, scores_out
from asyncinfer.scheduler.table import RowTable

logger = logging.getLogger(__name__)


@define
class ScheduledBatch:
    """A batch with the requests behind it."""

    batch: Batch
    reqs: list[Req]
    phase: str
    seq: int = 0      # 1, 2, ... in launch order


class Scheduler:
    """Continuous batching over a paged KV cache, with batch selection left to a Policy."""

    def __init__(self, runner: BatchRunner, policy: Policy, config: EngineConfig,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.runner = runner
        self.policy = policy
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.kv = KVManager(runner.num_pages, runner.page_size, runner.page_table,
                            config.cache_type)
        self.waiting = WaitingQueue(self._waiting_record, self.kv.match_length,
                                    lambda: self.kv.cache_version)  # preempted ones first
        self.running = RunningSet()             # uid -> request, decoding
        self.kv.on_admit = self.waiting.note_admitted  # counts the half-prefilled
        self.table = RowTable(runner.max_rows)
        self.round = 0
        self.decode_streak = 0
        self.tokens_computed = 0
        self.last_decision: Decision | None = None
        self.last_scheduled: ScheduledBatch | None = None
        self._events: list[Event] = []
        self._launched = 0                      # batches scheduled so far
        self._processed = 0                     # batches whose results were processed
        self._deferred: list[tuple[int, Req, bool]] = []  # (batch seq, req, keep): to release
        self._suspects: set[int] = set()        # uids of suspects (see recover)
        self._served: dict[str, list[int]] = {}  # tenant -> [input, output] since the view
        self._reserved: tuple[tuple[int, int, int], int] = ((-1, -1, -1), 0)  # (epochs, pages)

    def add_request(self, uid: int, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Queue a request; one that can never run finishes at once with an error event."""
        n, ctx = len(prompt_ids), self.runner.context_len
        capacity = self.runner.num_pages * self.runner.page_size
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
        elif params.max_tokens == 0 and params.prompt_logprobs is None:
            error = "max_tokens may be 0 only with prompt_logprobs (a scoring request)"
        if error is not None:
            self._events.append(Event(uid, None, "error", error, error_kind="invalid"))
            return
        max_tokens = min(params.max_tokens, ctx - n, capacity - n)
        self.waiting.append(Req(uid, list(prompt_ids), params, max_tokens, self.round))

    def abort(self, uid: int, notify: bool = True) -> bool:
        """Drop a request and free what it holds (``notify``: with an "abort" event)."""
        req = self._remove(uid)
        if req is None:
            return False
        self._end(req)
        if notify:
            self._events.append(Event(uid, None, "abort", prefix_len=req.prefix_len))
        return True

    def fail(self, uid: int, error: str) -> bool:
        """End a request with an "engine" error event; False if unknown."""
        req = self._remove(uid)
        if req is None:
            return False
        self._end(req)
        self._events.append(Event(uid, None, "error", error, req.prefix_len, "engine"))
        return True

    def preempt(self, uid: int, keep_prefix: bool = False) -> bool:
        """Send an admitted request to the front of the queue, to be recomputed with the
        same tokens; False if it holds nothing. ``keep_prefix``: its full pages go to the
        prefix cache. See docs/architecture.md, 'Preemption'."""
        req = self.running.get(uid)
        if req is None:
            req = self.waiting.get(uid)
            if req is None or not req.admitted:
                return False
            self.waiting.remove(req)
        else:
            del self.running[uid]
        self._release(evolve(req), keep=keep_prefix)
        req.drop_row()
        req.pages, req.shared_pages, req.prefix_handle = [], 0, None
        req.cached_len = req.device_len = 0
        req.preemptions += 1
        self.waiting.push_front(req)
        return True

    def recover(self, failed: ScheduledBatch, later: ScheduledBatch | None, error: str) -> None:
        """Undo ``failed`` (its forward raised) and ``later`` (launched after it), neither
        running nor processed: a lone request is failed, the others preempted, ``failed``'s
        as suspects. See docs/architecture.md, 'Failure isolation'."""
        last = later or failed
        assert failed.seq == self._processed + 1 and last.seq == self._launched, (
            "recover the oldest unprocessed batch, and the one launched after it")
        self._processed = last.seq
        self.round += last.seq - failed.seq + 1
        self._release_deferred()
        alone = failed.batch.size == 1
        for req in reversed(self._members(failed)):
            if alone:
                self.fail(req.uid, error)
            else:
                req.suspect = True
                self._suspects.add(req.uid)
                self.preempt(req.uid)
        if later is not None:
            for req in reversed(self._members(later)):  # those preempted above hold no row
                self.preempt(req.uid)

    @property
    def has_work(self) -> bool:
        """Something waits, runs, is being released or has an event to report."""
        return bool(self.waiting or self.running or self._events or self._deferred)

    @property
    def in_flight(self) -> int:
        """Batches launched whose results have not been processed yet."""
        return self._launched - self._processed

    def view(self) -> SchedulerView:
        """What a policy decides from, in O(1): the queues are read lazily (see
        docs/architecture.md, 'Scheduler view cost')."""
        reserved = self._reserved_pages()
        return SchedulerView(
            waiting=LiveWaiting(self.waiting, self._waiting_record, self.round),
            running=LiveRunning(self.running, self.round),
            free_pages=max(0, self.kv.available_pages - reserved),
            free_slots=self.table.num_free,
            token_budget=self.config.max_extend_tokens,
            page_size=self.runner.page_size,
            round=self.round,
            decode_streak=self.decode_streak,
            served=tuple(TenantService(t, *self._served[t]) for t in sorted(self._served)),
        )

    def _waiting_record(self, r: Req) -> WaitingRequest:
        return WaitingRequest(r.uid, r.seq_len, r.seq_len - r.cached_len, r.remaining_tokens,
                              r.arrival_round, self.round - r.arrival_round, r.admitted,
                              r.params.priority, r.preemptions, r.params.tenant, r.match_len)

    def schedule(self) -> ScheduledBatch | None:
        """The policy's batch, else a decode (a waiting suspect runs alone), else None."""
        if not (self.waiting or self.running):
            return None
        suspect = self._waiting_suspect() if self._suspects else None
        decision = None
        if suspect is not None:
            batch = self._schedule_alone(suspect)
        else:
            view = self.view()
            self._served.clear()  # the policy has seen it
            decision = self.last_decision = self.policy.decide(view)
            batch = (self._schedule_prefill(decision) if decision.action == "prefill" else
                     self._schedule_mixed(decision) if decision.action == "mixed" else None)
        if batch is None:
            batch = self._schedule_decode()
        if batch is None:
            if self.in_flight == 0 and not self.running and not self._deferred:
                raise EngineError(self._stuck(decision, suspect))
            return None
        self._launched += 1
        batch.seq = self._launched
        self.decode_streak = self.decode_streak + 1 if batch.phase == "decode" else 0
        self.last_scheduled = batch
        return batch

    def _schedule_prefill(self, decision: Decision) -> ScheduledBatch | None:
        self._preempt_for(decision)
        adder = self._admit(decision, self._prefill_adder())
        return self._build([], adder) if adder.admitted else None

    def _schedule_mixed(self, decision: Decision) -> ScheduledBatch | None:
        """Decode the chosen running requests and prefill candidates in the budget they leave;
        decode pages are taken before admission counts what is free. See
        docs/architecture.md, 'Mixed batches'."""
        self._preempt_for(decision)
        chosen = None if decision.decoding is None else set(decision.decoding)
        decoding = self._decodable(chosen)
        self._grow(decoding)
        budget = self.config.max_extend_tokens
        if decision.token_budget is not None:
            budget = min(budget, decision.token_budget)
        adder = self._admit(decision, self._prefill_adder(budget - len(decoding)))
        return self._build(decoding, adder) if decoding or adder.admitted else None

    def _preempt_for(self, decision: Decision) -> None:
        for uid in decision.preempt:  # running requests only; their KV stays valid
            if uid in self.running and not self.running[uid].suspect:
                self.preempt(uid, keep_prefix=True)

    def _admit(self, decision: Decision, adder: PrefillAdder) -> PrefillAdder:
        """Offer the half-prefilled requests, then the decision's candidates, in order."""
        by_uid = self.waiting  # uid -> request
        order = [r.uid for r in self.waiting.admitted()]
        order += [u for u in decision.candidates if u in by_uid and not by_uid[u].admitted]
        for uid in order:
            if not adder.try_add(by_uid[uid]) and decision.on_misfit == "stop":
                break
        return adder

    def _schedule_alone(self, req: Req) -> ScheduledBatch | None:
        adder = self._prefill_adder()
        return self._build([], adder) if adder.try_add(req) else None

    def _prefill_adder(self, budget: int | None = None) -> PrefillAdder:
        return PrefillAdder(self.kv, self.config.max_extend_tokens if budget is None else budget,
                            self.table.num_free, self._reserved_pages(),
                            self.config.chunked_prefill)

    def _decodable(self, chosen: set[int] | None = None) -> list[Req]:
        """Running requests (in ``chosen``, if given) with a token left to compute."""
        return [r for r in self._running_in_uid_order()
                if r.device_len < r.max_len and not r.suspect
                and (chosen is None or r.uid in chosen)]

    def _grow(self, decoding: list[Req]) -> None:
        """Give decoding requests crossing into a new page that page (reserved for them)."""
        size = self.runner.page_size
        for req in decoding:
            if req.device_len > len(req.pages) * size:
                self.kv.allocate(req, req.device_len)

    def _schedule_decode(self) -> ScheduledBatch | None:
        reqs = self._decodable()
        if not reqs:
            return None
        self._grow(reqs)
        return self._build(reqs, None)

    def _build(self, decoding: list[Req], adder: PrefillAdder | None) -> ScheduledBatch:
        """One batch: ``decoding``'s next tokens, then the admitted prefills or chunks."""
        admitted = adder.admitted if adder is not None else []
        for req, end in admitted:
            if req.row_state is RowState.CLAIMED:  # newly admitted: rows go in batch order
                row = self.table.allocate()
                req.take_row(row)
                self.runner.write_prompt(row, req.token_ids())
                self.kv.admit(req)
                if req.preemptions == 0:  # its first admission: the prompt is served once
                    self._served.setdefault(req.params.tenant, [0, 0])[0] += len(req.prompt_ids)
            self.kv.allocate(req, end)
        prefilling = [req for req, _ in admitted]
        reqs = decoding + prefilling
        batch = Batch(rows=_rows(reqs),
                      starts=[r.device_len - 1 for r in decoding] + [r.cached_len
                                                                     for r in prefilling],
                      ends=[r.device_len for r in decoding] + [end for _, end in admitted],
                      params=[r.params for r in reqs],
                      steps=[r.device_len - r.prompt_len for r in decoding] + [
                          len(r.output_ids) for r in prefilling],
                      sample=[True] * len(decoding) + [e == r.seq_len and r.max_tokens > 0
                                                       for r, e in admitted],
                      scored=scored_counts(decoding, admitted),
                      prompt_lens=[r.prompt_len for r in reqs])
        for req in decoding:
            req.cached_len = req.device_len
            req.device_len += 1
        for req, end in admitted:
            req.cached_len = end
            if end == req.seq_len:  # its next token is on the way: it decodes from now on
                # A scoring request (max_tokens 0) samples none: it ends once processed.
                req.device_len = end + (req.max_tokens > 0)
                self.waiting.remove(req)
                self.running[req.uid] = req
        phase = "mixed" if decoding and admitted else "decode" if decoding else "prefill"
        return ScheduledBatch(batch, reqs, phase)

    def step(self) -> list[Event]:
        """One round without overlap: schedule, run the batch, process its results."""
        scheduled = self.schedule()
        if scheduled is not None:
            out = self.runner.forward(scheduled.batch)
            self.process(scheduled, out.next_tokens.tolist(), out.logprobs,
                         out.prompt_logprobs)
        return self.take_events()

    def take_events(self) -> list[Event]:
        """Events produced since the last call, in order."""
        events, self._events = self._events, []
        return events

    def process(self, scheduled: ScheduledBatch, tokens: list[int],
                logprobs: TopLogprobs | None = None,
                prompt_logprobs: TopLogprobs | None = None) -> None:
        """Hand each request its token (and logprobs, as ``ForwardOutput`` has them) and
        finish those that are done; in launch order."""
        assert scheduled.seq == self._processed + 1, "batches processed out of order"
        self._processed = scheduled.seq
        self.round += 1
        self.tokens_computed += scheduled.batch.num_tokens
        self._release_deferred()
        batch = scheduled.batch
        if prompt_logprobs is not None:
            gather_scores(scheduled.reqs, batch, prompt_logprobs)
        for req, row, sampled, token, end, logprob in zip(
                scheduled.reqs, batch.rows, batch.sample, tokens, batch.ends,
                sampled_logprobs(batch, tokens, logprobs)):
            if req.finished or req.row != row:  # finished or preempted since
                continue
            if not sampled:
                if req.max_tokens == 0 and end == req.seq_len:  # a scoring request's end
                    self._finish(req, Event(req.uid, None, "length", prefix_len=req.prefix_len,
                                            prompt_logprobs=scores_out(req)))
                continue  # else a mid-prompt chunk
            if req.suspect:  # its lone batch sampled: it batches with the others again
                req.suspect = False
                self._suspects.discard(req.uid)
            req.output_ids.append(token)
            served = self._served.get(req.params.tenant)
            if served is None:
                served = self._served[req.params.tenant] = [0, 0]
            served[1] += 1
            reason: FinishReason | None = None
            if self._stops(req, token):
                reason = "stop"
            elif req.remaining_tokens <= 0:
                reason = "length"
            event = Event(req.uid, token, reason, prefix_len=req.prefix_len, logprob=logprob,
                          prompt_logprobs=scores_out(req))
            if reason is None:
                self._events.append(event)
                if req.params.choices > 1 and len(req.output_ids) == 1:
                    self.kv.share(req)  # its other choices come next: they find the prompt
            else:
                self._finish(req, event)

    def _finish(self, req: Req, event: Event) -> None:
        self._events.append(event)
        req.finished = True
        del self.running[req.uid]
        self._release(req, keep=True)

    def _stops(self, req: Req, token: int) -> bool:
        """``token`` ends the request: EOS (unless ignore_eos) or one of its stop_token_ids,
        once ``min_tokens`` came before it (the sampler holds them back until then)."""
        params = req.params
        return ((token in self.eos_token_ids and not params.ignore_eos)
                or token in params.stop_token_ids) and len(req.output_ids) > params.min_tokens

    def _running_in_uid_order(self) -> list[Req]:
        return self.running.in_uid_order()

    def _waiting_suspect(self) -> Req | None:
        """The suspect to run next (a half-prefilled one first); None if all are running."""
        waiting = self.waiting
        suspects = sorted((r for u in self._suspects if (r := waiting.get(u)) is not None),
                          key=lambda r: waiting.place(r.uid))
        return next((r for r in suspects if r.admitted), suspects[0] if suspects else None)

    def _stuck(self, decision: Decision | None, suspect: Req | None) -> str:
        if decision is None:
            assert suspect is not None
            return f"request {suspect.uid}, a suspect, does not fit into an idle engine"
        return (f"policy {self.policy.name!r} admitted nothing into an idle engine "
                f"(decision {decision.action}, candidates {list(decision.candidates)[:8]}); "
                "a policy must offer a waiting request when nothing is running")

    def _members(self, scheduled: ScheduledBatch) -> list[Req]:
        """The requests of a launched batch that still hold the row it ran them in."""
        return [r for r, row in zip(scheduled.reqs, scheduled.batch.rows)
                if not r.finished and r.row == row]

    def _remove(self, uid: int) -> Req | None:
        req = self.waiting.pop(uid)
        return req if req is not None else self.running.pop(uid, None)

    def _end(self, req: Req) -> None:
        req.finished = True
        req.suspect = False
        self._suspects.discard(req.uid)
        if req.admitted:
            self._release(req, keep=False)

    def _reserved_pages(self) -> int:
        """Pages admitted requests may still claim: O(rows), once per change of their pages
        or of who is admitted (the view and the prefill of one round share it)."""
        epochs = (self.kv.epoch, self.running.epoch, self.waiting.epoch)
        if epochs != self._reserved[0]:
            size = self.runner.page_size
            active = self.running.in_uid_order() + self.waiting.admitted()
            self._reserved = epochs, sum(
                (len(r.prompt_ids) + r.max_tokens + size - 1) // size - len(r.pages)
                for r in active)
        return self._reserved[1]

    def _release(self, req: Req, keep: bool) -> None:
        if self.in_flight:  # a launched batch may still read or write its row and pages
            self._deferred.append((self._launched, req, keep))
            return
        self.kv.release(req, keep)
        self.table.release(req.drop_row())

    def _release_deferred(self) -> None:
        waiting = []
        for batch_seq, req, keep in self._deferred:
            if batch_seq > self._processed:
                waiting.append((batch_seq, req, keep))
                continue
            self.kv.release(req, keep)
            self.table.release(req.drop_row())
        self._deferred = waiting

    def abort_all(self) -> None:
        """Drop every request after a failed round; launched batches count as done."""
        self._processed = self._launched
        for uid in [r.uid for r in self.waiting] + list(self.running):
            self.abort(uid, notify=False)
        self._release_deferred()

    def flush_cache(self) -> tuple[int, int]:
        """Empty the prefix cache of the pages no request holds (``KVManager.flush_cache``)."""
        return self.kv.flush_cache()

    def flush(self) -> None:
        """Release what finished requests hold once no batch is in flight."""
        if self.in_flight == 0:
            self._release_deferred()

    @property
    def free_rows(self) -> list[int]:
        return self.table.free_rows

    def check_invariants(self) -> None:
        """Pages and rows are each free, cached or owned once; row states, prefix locks,
        reservations and suspects agree with what requests hold."""
        active = list(self.running.values()) + [r for r in self.waiting if r.admitted]
        active += [req for _, req, _ in self._deferred]
        owned = sum(len(r.pages) - r.shared_pages for r in active)
        free, cached = self.kv.allocator.num_free, self.kv.cached_pages
        assert free + cached + owned == self.runner.num_pages, (free, cached, owned)
        for req in [*self.waiting, *self.running.values(), *active]:
            assert req.row_state is not RowState.CLAIMED, req.uid
            assert (req.row is not None) == (req.row_state is RowState.HELD), req.uid
            assert (req.prefix_handle is not None) == (req.shared_pages > 0), req.uid
        rows = sorted(_rows(active) + self.table.free_rows)
        assert rows == list(range(self.runner.max_rows)), rows
        assert self._reserved_pages() <= self.kv.available_pages
        size = self.runner.page_size
        assert self._reserved_pages() == sum(
            (r.max_len + size - 1) // size - len(r.pages)
            for r in [*self.running.values(), *self.waiting] if r.admitted)
        suspects = {r.uid for r in [*self.waiting, *self.running.values()] if r.suspect}
        assert suspects == self._suspects, (suspects, self._suspects)
        self.waiting.check()
        assert list(self.running) == sorted(self.running), list(self.running)


def _rows(reqs: list[Req]) -> list[int]:
    """The rows of requests that hold one (unchecked: hot)."""
    return cast("list[int]", [r.row for r in reqs])
