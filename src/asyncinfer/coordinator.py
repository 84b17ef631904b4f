"""The asyncio coordinator: one task that feeds the scheduler, launches batches and
delivers their events, never blocking the loop. See docs/architecture.md, "The coordinator"."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, cast

from attrs import define, frozen

from asyncinfer.core import Batch, ErrorKind, Event, ForwardOutput
from asyncinfer.distributed.sync import RankError, RankLostError, RoundSync
from asyncinfer.errors import EngineError
from asyncinfer.outputs import CacheFlush, Channel
from asyncinfer.params import SamplingParams
from asyncinfer.processes import watch_exit
from asyncinfer.scheduler.scheduler import ScheduledBatch, Scheduler

logger = logging.getLogger(__name__)


@define
class _Add:
    uid: int
    prompt_ids: list[int]
    params: SamplingParams


@define
class _Abort:
    uid: int
    notify: bool


@define
class _Flush:
    """Empty the prefix cache between rounds (every rank, in rank 0's order of commands);
    ``ticket`` names the caller's future on rank 0."""

    ticket: int


_Command = _Add | _Abort | _Flush | None


@frozen
class Round:
    """One round as an observer sees it: its start, host and device-wait seconds, and the
    batch it left in flight (phase "" and size 0 when none)."""

    start: float
    host_s: float
    wait_s: float
    phase: str
    size: int


RoundObserver = Callable[[Round], None]


@define
class _Launched:
    scheduled: ScheduledBatch
    future: asyncio.Future[ForwardOutput]


class Coordinator:
    """Owns the scheduler's loop; frontends talk to it only through ``add`` and ``abort``."""

    def __init__(self, scheduler: Scheduler,
                 launch: Callable[[Batch], Callable[[], ForwardOutput]],
                 overlap: bool = True, synchronize: Callable[[], None] | None = None,
                 sync: RoundSync | None = None,
                 executor: ThreadPoolExecutor | None = None,
                 kv_events: Callable[[list[Any]], None] | None = None) -> None:
        self.scheduler = scheduler
        self.launch = launch
        self.synchronize = synchronize or (lambda: None)
        self.overlap = overlap
        self.kv_events = kv_events   # given each round's KV-cache events, if set
        self.batches = {"prefill": 0, "decode": 0, "mixed": 0}
        self._commands: asyncio.Queue[_Command] = asyncio.Queue()
        self._channels: dict[int, Channel] = {}
        self._queued_adds = 0                   # requests added but not yet applied
        self._waited = 0.0                      # seconds awaiting the device, all rounds
        self._rounds = 0
        self._round_s = 0.0                     # seconds in rounds, waits included
        self._device_s = 0.0                    # seconds the device spent on batches
        # Where batches run and are awaited; shut down when the loop stops.
        self._executor = executor or ThreadPoolExecutor(max_workers=1,
                                                        thread_name_prefix="asyncinfer-wait")
        self._task: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()            # set while the loop waits with nothing to do
        self.observer: RoundObserver | None = None  # called after every round, if set
        # Rank 0 leads, the others follow; exchanges run off the loop (see "The coordinator").
        self.sync = sync
        self._sync_thread = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncinfer-sync")
                             if sync is not None else None)
        self._sampled: list[int] = []           # the tokens of the last batch processed
        self._lost: RankError | None = None   # why the loop was ended from outside
        self._unwatch: list[Callable[[], None]] = []
        self._flushes: dict[int, asyncio.Future[CacheFlush]] = {}
        self._tickets = itertools.count()

    def add(self, uid: int, prompt_ids: list[int], params: SamplingParams,
            channel: Channel) -> None:
        """Queue a request; its events go to ``channel`` in order, the last one finished.
        ``uid`` must not be in use."""
        if self._task is not None and self._task.done():  # the loop died: nobody would answer
            died = None if self._task.cancelled() else self._task.exception()
            if isinstance(died, RankLostError):
                channel.put_nowait(Event(uid, None, "error", str(died),
                                         error_kind="unavailable"))
            else:
                channel.put_nowait(Event(uid, None, "error", "the engine is not running",
                                         error_kind="engine"))
            return
        self._channels[uid] = channel
        self._commands.put_nowait(_Add(uid, prompt_ids, params))
        self._queued_adds += 1

    def abort(self, uid: int, notify: bool = False) -> None:
        """Stop a request and free what it holds; its channel gets no more events."""
        self._channels.pop(uid, None)
        self._commands.put_nowait(_Abort(uid, notify))

    def abort_all(self) -> None:
        """End every request now with "abort"; the loop frees them at its next round."""
        sched = self.scheduler
        prefix = {r.uid: r.prefix_len for r in [*sched.waiting, *sched.running.values()]}
        for uid in list(self._channels):
            self._channels.pop(uid).put_nowait(Event(uid, None, "abort",
                                                     prefix_len=prefix.get(uid, 0)))
            self._commands.put_nowait(_Abort(uid, notify=False))

    async def flush_cache(self) -> CacheFlush:
        """Empty the prefix cache of every page no request holds, at the next round's start
        (what is running goes on; what it holds stays)."""
        if self._task is None or self._task.done():
            raise EngineError("the engine is not running")
        ticket = next(self._tickets)
        future = self._flushes[ticket] = asyncio.get_running_loop().create_future()
        self._commands.put_nowait(_Flush(ticket))
        try:
            return await future
        finally:
            self._flushes.pop(ticket, None)

    @property
    def failed(self) -> bool:
        """The loop ended of an error (a tensor-parallel rank gone, ranks out of step)."""
        return self._task is not None and self._task.done() and (
            self._task.cancelled() or self._task.exception() is not None)

    @property
    def alive(self) -> bool:
        """The loop is started and has not ended (stopped, or died of an error)."""
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the loop task on the running event loop."""
        assert self._task is None, "already started"
        self._task = asyncio.get_running_loop().create_task(self._run(), name="asyncinfer")
        if self.sync is not None and self.sync.leader:
            for rank, pid in self.sync.pids.items():
                self._unwatch.append(watch_exit(pid, partial(self._rank_gone, rank)))

    def _rank_gone(self, rank: int) -> None:
        """Another rank's process exited: end the loop and every request with the reason."""
        assert self.sync is not None
        if self.sync.closing or self._task is None or self._task.done():
            return
        gone = self.sync.lost() or f"rank {rank} exited"
        self._lost = RankLostError(f"tensor-parallel {gone}; rank {self.sync.rank} stops")
        logger.error("%s", self._lost)
        self._task.cancel()

    async def stop(self) -> None:
        """Cancel every request, let the batch in flight finish, end the loop."""
        if self._task is None:
            return
        self._commands.put_nowait(None)
        with contextlib.suppress(Exception, asyncio.CancelledError):  # logged when it died
            await self._task
        self._task = None
        for unwatch in self._unwatch:
            unwatch()
        self._executor.shutdown(wait=self._lost is None)
        if self._sync_thread is not None:
            self._sync_thread.shutdown(wait=self._lost is None)

    async def join(self) -> None:
        """Await the loop's end; raises what ended it, if an error."""
        assert self._task is not None, "not started"
        await self._task

    async def wait_stopped(self) -> None:
        """Return once the loop has ended (stopped, or died); raises and cancels nothing."""
        if self._task is not None:
            await asyncio.wait([self._task])

    async def wait_idle(self) -> None:
        """Return once every command is applied and nothing runs or waits (or the loop died)."""
        while self._task is None or not self._task.done():
            await self._idle.wait()
            if self._commands.empty():
                return
            await asyncio.sleep(0)

    async def _run(self) -> None:
        why, kind = "the engine loop stopped", cast(ErrorKind, "engine")
        try:
            await self._loop()
        except asyncio.CancelledError:
            if self._lost is None:
                raise
            why, kind = str(self._lost), "unavailable"
            raise self._lost from None
        except RankLostError as exc:
            logger.error("%s", exc)
            why, kind = str(exc), "unavailable"
            raise
        except Exception as exc:
            logger.exception("the engine loop died")
            why = f"the engine loop stopped: {exc}"
            raise
        finally:
            if self.sync is not None and kind == "unavailable":
                self.sync.closing = True  # this rank stops: the others' exits are expected
            for uid in list(self._channels):
                self._deliver([Event(uid, None, "error", why, error_kind=kind)])
            for future in self._flushes.values():
                if not future.done():
                    future.set_exception(EngineError(why))
            self._idle.set()

    async def _loop(self) -> None:
        inflight: _Launched | None = None
        while True:
            commands: list[_Command] = []
            if self.sync is None or self.sync.leader:
                if inflight is None and not self.scheduler.has_work:
                    self._idle.set()
                    commands.append(await self._commands.get())
                    self._idle.clear()
                while not self._commands.empty():
                    commands.append(self._commands.get_nowait())
                commands = self._effective(commands)
            if self.sync is not None:  # every rank applies rank 0's commands, in its order
                commands = await self._in_sync_thread(self.sync.share, commands)
                if None in commands:
                    self.sync.closing = True
            if not all(self._apply(command) for command in commands):
                await self._fail_all("the engine is shutting down")
                break
            start, waited = time.perf_counter(), self._waited
            try:
                inflight = await self._round(inflight)
            except RankError:
                raise  # ranks out of step or gone: no rank can go on, the loop ends
            except Exception as exc:  # the scheduler failed, not a batch: end everything
                logger.exception("engine round failed")
                await self._fail_all(f"engine error: {exc}")
                inflight = None
            self._deliver(self.scheduler.take_events())
            if self.kv_events is not None:
                self.kv_events(self.scheduler.kv.prefix.take_events())
            self._rounds += 1
            self._round_s += time.perf_counter() - start
            if self.observer is not None:
                self.observer(self._record(start, self._waited - waited, inflight))

    @staticmethod
    def _record(start: float, wait: float, inflight: _Launched | None) -> Round:
        batch = None if inflight is None else inflight.scheduled.batch
        return Round(start, time.perf_counter() - start - wait, wait,
                     batch.phase if batch else "", batch.size if batch else 0)

    async def _round(self, inflight: _Launched | None) -> _Launched | None:
        launched = None
        if self.overlap or inflight is None:
            scheduled = self.scheduler.schedule()
            if scheduled is not None:
                if self.sync is not None:
                    await self._in_sync_thread(self.sync.check,
                                               partial(self._digest_fields, scheduled))
                launched = self._launch(scheduled)
        if inflight is not None and not await self._finish(inflight, launched):
            launched = None  # it read the failed batch's tokens: recovered with it
        if launched is not None and not self.overlap:
            await self._finish(launched, None)
            launched = None
        self.scheduler.flush()
        return launched

    def _launch(self, scheduled: ScheduledBatch) -> _Launched:
        """Start a batch; a launch that raises is a batch that failed, reported when it is
        finished, in launch order, like a failed forward."""
        self.batches[scheduled.phase] += 1
        loop = asyncio.get_running_loop()
        try:
            wait = self.launch(scheduled.batch)
        except Exception as exc:
            failed: asyncio.Future[ForwardOutput] = loop.create_future()
            failed.set_exception(exc)
            return _Launched(scheduled, failed)
        future = loop.run_in_executor(self._executor, wait)
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        return _Launched(scheduled, future)

    async def _finish(self, launched: _Launched, later: _Launched | None) -> bool:
        """Await a batch and process its tokens; if it failed, recover it and ``later`` (the
        batch launched after it) instead, and return False."""
        start = time.perf_counter()
        try:
            out = await launched.future
            tokens = out.next_tokens.tolist()
            self._device_s += out.device_s
        except Exception as exc:
            self._waited += time.perf_counter() - start
            if self.sync is not None:  # the other ranks ran theirs: no retrying it alone
                raise await self._in_sync_thread(self.sync.failure, exc) from exc
            await self._recover(launched, later, exc)
            return False
        self._waited += time.perf_counter() - start
        if self.sync is not None:
            self._sampled = tokens
        self.scheduler.process(launched.scheduled, tokens, out.logprobs, out.prompt_logprobs)
        return True

    def _digest_fields(self, scheduled: ScheduledBatch) -> dict[str, Any]:
        """What the ranks compare of a batch: its requests in order, their rows, positions
        and KV slots (ranks with the same requests on different pages would each attend to
        what the other wrote), what it samples, and the tokens the previous batch sampled."""
        b = scheduled.batch
        table = self.scheduler.runner.page_table
        return {"phase": scheduled.phase, "requests": [r.uid for r in scheduled.reqs],
                "rows": b.rows, "starts": b.starts, "ends": b.ends, "sample": b.sample,
                "slots": [table[row, s:e].tolist() for row, s, e in zip(b.rows, b.starts,
                                                                       b.ends)],
                "tokens sampled before": self._sampled}

    async def _in_sync_thread(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)`` in the thread of the ranks' exchanges, off the loop."""
        return await asyncio.get_running_loop().run_in_executor(self._sync_thread, call, *args)

    async def _recover(self, failed: _Launched, later: _Launched | None,
                       exc: Exception) -> None:
        batch = failed.scheduled.batch
        logger.error("batch %d (%s of %d requests) failed; %s", failed.scheduled.seq,
                     batch.phase, batch.size, "its request is failed" if batch.size == 1
                     else "its requests are re-queued, each to run alone", exc_info=exc)
        if later is not None:
            with contextlib.suppress(Exception):
                await later.future
        try:
            await self._synchronized()
        except Exception:
            logger.exception("the device did not synchronize after a failed batch")
        self.scheduler.recover(failed.scheduled, later.scheduled if later else None,
                               f"engine error: {exc}")

    async def _synchronized(self) -> None:
        """Wait until the device has done what was launched: on the batches' thread, or
        here where that thread is gone (an engine closed at interpreter exit, whose
        executors Python has already ended)."""
        try:
            future = asyncio.get_running_loop().run_in_executor(self._executor,
                                                                self.synchronize)
        except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
            self.synchronize()
            return
        await future

    def _effective(self, commands: list[_Command]) -> list[_Command]:
        """The commands to apply: an add whose request was aborted while it sat in the
        queue is dropped."""
        kept: list[_Command] = []
        for command in commands:
            if isinstance(command, _Add):
                self._queued_adds -= 1
                if command.uid not in self._channels:
                    continue
            kept.append(command)
        return kept

    def _apply(self, command: _Command) -> bool:
        if command is None:
            return False
        if isinstance(command, _Add):
            self.scheduler.add_request(command.uid, command.prompt_ids, command.params)
        elif isinstance(command, _Flush):
            freed, held = self.scheduler.flush_cache()
            future = self._flushes.get(command.ticket)
            if future is not None and not future.done():
                future.set_result(CacheFlush(freed, held))
        else:
            self.scheduler.abort(command.uid, notify=command.notify)
        return True

    def _deliver(self, events: list[Event]) -> None:
        for event in events:
            channel = self._channels.get(event.uid)
            if channel is None:
                continue
            channel.put_nowait(event)
            if event.finished:
                del self._channels[event.uid]

    async def _fail_all(self, message: str) -> None:
        """End every request with an error and return the scheduler to a clean state."""
        await self._synchronized()
        self._deliver(self.scheduler.take_events())
        self.scheduler.abort_all()
        for uid in list(self._channels):
            self._deliver([Event(uid, None, "error", message, error_kind="engine")])

    def stats(self) -> dict[str, Any]:
        """The fields of ``outputs.EngineStats``; adds not yet applied count as waiting."""
        sched = self.scheduler
        total = sched.runner.num_pages
        prefix = sched.kv.stats
        return {"waiting": len(sched.waiting) + self._queued_adds,
                "running": len(sched.running),
                "kv_pages_total": total,
                "kv_pages_used": total - sched.kv.allocator.num_free - sched.kv.cached_pages,
                "batches_prefill": self.batches["prefill"],
                "batches_decode": self.batches["decode"],
                "batches_mixed": self.batches["mixed"],
                "prefix_cache_queries": prefix.queries, "prefix_cache_hits": prefix.hits,
                "prefix_cache_query_tokens": prefix.query_tokens,
                "prefix_cache_hit_tokens": prefix.hit_tokens,
                "rounds": self._rounds,
                "round_host_seconds": self._round_s - self._waited,
                "round_wait_seconds": self._waited,
                "device_busy_seconds": self._device_s}
