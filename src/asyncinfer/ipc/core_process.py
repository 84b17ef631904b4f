"""The engine core process: an ``AsyncEngine`` fed over ZeroMQ, one :class:`~.messages.Out`
per round per front. It ignores SIGINT and SIGHUP (the server drains its fronts first);
SIGTERM, a Shutdown or the server's exit stops it, and it removes its sockets' directory.
See docs/architecture.md, "The engine core"."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any

import attrs
import zmq
import zmq.asyncio

from asyncinfer.core import Event
from asyncinfer.errors import AsyncInferError
from asyncinfer.ipc import messages as msg
from asyncinfer.outputs import EngineStats
from asyncinfer.processes import new_event_loop, watch_exit

logger = logging.getLogger(__name__)

STATS_INTERVAL = 0.1


@attrs.define
class _Box:
    """What one front gets at the next flush."""

    uids: list[int] = attrs.Factory(list)
    tokens: list[int] = attrs.Factory(list)
    ends: list[msg.End] = attrs.Factory(list)
    logprobs: list[tuple[int, msg.Logprob]] = attrs.Factory(list)
    prompts: list[msg.PromptLogprobs] = attrs.Factory(list)


class _Remote:
    """The channel of one request of one front: its events go to that front's box."""

    __slots__ = ("box", "core", "front")

    def __init__(self, core: EngineCore, front: int) -> None:
        self.core, self.front, self.box = core, front, core._boxes[front]

    def put_nowait(self, event: Event) -> None:
        box = self.box
        if event.prompt_logprobs is not None:
            box.prompts.append(msg.PromptLogprobs(event.uid, [
                None if e is None else msg.Logprob.of(e) for e in event.prompt_logprobs]))
        if event.token is not None:
            if event.logprob is not None:
                box.logprobs.append((len(box.uids), msg.Logprob.of(event.logprob)))
            box.uids.append(event.uid)
            box.tokens.append(event.token)
        if event.finished:
            box.ends.append(msg.End(event.uid, event.finish_reason or "abort", event.error,
                                    event.error_kind, event.prefix_len))
            self.core._open[self.front].discard(event.uid)
        self.core._want_flush()


class EngineCore:
    """Serves ``engine`` to ``fronts`` front processes at ``addresses``."""

    def __init__(self, engine: Any, addresses: msg.Addresses, fronts: int) -> None:
        self.engine = engine
        self.fronts = fronts
        self._ctx = zmq.asyncio.Context()
        self._inbound = self._ctx.socket(zmq.PULL)
        self._inbound.setsockopt(zmq.RCVHWM, 0)
        self._inbound.bind(addresses.inbound)
        self._sync_ctx = zmq.Context()
        self._outbound = []
        for front in range(fronts):
            sock = self._sync_ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # never block the loop: a slow front queues
            sock.setsockopt(zmq.LINGER, 1000)
            sock.bind(addresses.outbound(front))
            self._outbound.append(sock)
        self._boxes = [_Box() for _ in range(fronts)]
        self._open: list[set[int]] = [set() for _ in range(fronts)]
        self._received = [0] * fronts
        self._sent_stats: list[EngineStats | None] = [None] * fronts
        self._flush_pending = False
        self._tasks: set[asyncio.Task[None]] = set()   # flushes of the prefix cache
        self._stop = asyncio.Event()
        self.failed = False

    def stop(self) -> None:
        """Ask :meth:`run` to end (from a signal handler or a watcher)."""
        self._stop.set()

    async def run(self) -> None:
        """Serve until stopped, then end what is open and tell the fronts."""
        await self.engine.start()
        tasks = [asyncio.create_task(self._receive(), name="asyncinfer-core-in"),
                 asyncio.create_task(self._report(), name="asyncinfer-core-stats")]
        stopped = asyncio.create_task(self._stop.wait())
        ended = asyncio.create_task(self.engine.wait_stopped())
        try:
            await asyncio.wait([stopped, ended], return_when=asyncio.FIRST_COMPLETED)
            if ended.done() and not self._stop.is_set():
                # Its loop died (a rank gone): the ends go out below; the core exits.
                logger.error("the engine stopped; the engine core exits")
                self.failed = True
        finally:
            for task in (stopped, ended):
                task.cancel()
            for task in [*tasks, *self._tasks]:
                task.cancel()
            for task in [*tasks, *self._tasks]:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await self.engine.close()    # open requests end with an error event
            self._flush()
            for sock in [self._inbound, *self._outbound]:
                sock.close()
            self._ctx.term()
            self._sync_ctx.term()

    async def _receive(self) -> None:
        while True:
            data = await self._inbound.recv()
            try:
                self._apply(msg.decode_inbound(data))
            except Exception:  # a malformed message must not take the core down
                logger.exception("engine core: a message could not be applied")

    def _apply(self, message: msg.Inbound) -> None:
        if isinstance(message, msg.Add):
            front = message.front
            self._received[front] += 1
            channel = _Remote(self, front)
            try:
                params = msg.params_from(message.params)
                self.engine.check_params(params)
            except Exception as exc:
                channel.put_nowait(Event(message.uid, None, "error", str(exc),
                                         error_kind="invalid"))
                return
            self._open[front].add(message.uid)
            self.engine.submit(message.uid, message.prompt_ids, params, channel)
        elif isinstance(message, msg.Abort):
            for uid in message.uids:
                self.engine.abort(uid)
                for open_uids in self._open:
                    open_uids.discard(uid)
        elif isinstance(message, msg.AbortAll):
            for uid in sorted(self._open[message.front]):
                self.engine.abort(uid)
            self._open[message.front].clear()
        elif isinstance(message, msg.Shutdown):
            self.stop()
        elif isinstance(message, msg.Hello):
            self._send(message.front, msg.Out([], [], [], self.engine.stats(),
                                              self._received[message.front]))
        elif isinstance(message, msg.FlushCache):
            task = asyncio.get_running_loop().create_task(self._flush_cache(message))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _flush_cache(self, message: msg.FlushCache) -> None:
        try:
            done = await self.engine.flush_cache()
            answer = msg.Flushed(message.ticket, done.freed_pages, done.held_pages)
        except Exception as exc:
            answer = msg.Flushed(message.ticket, error=str(exc))
        self._send(message.front, msg.Out([], [], [], self.engine.stats(),
                                          self._received[message.front], flushed=[answer]))

    def _want_flush(self) -> None:
        if not self._flush_pending:
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send every front with news its message for this round."""
        self._flush_pending = False
        stats = self.engine.stats()
        for front, box in enumerate(self._boxes):
            if box.uids or box.ends or box.prompts:
                self._send(front, msg.Out(box.uids, box.tokens, box.ends, stats,
                                          self._received[front], box.logprobs, box.prompts))
                box.uids, box.tokens, box.ends = [], [], []
                box.logprobs, box.prompts = [], []

    def _send(self, front: int, out: msg.Out) -> None:
        self._sent_stats[front] = out.stats
        try:
            self._outbound[front].send(msg.encode(out), flags=zmq.NOBLOCK)
        except zmq.Again:  # not connected (yet, or any more): nobody to tell
            logger.debug("engine core: front %d is not connected", front)

    async def _report(self) -> None:
        """Changed counters to every front, between rounds that say nothing to it."""
        while True:
            await asyncio.sleep(STATS_INTERVAL)
            stats = self.engine.stats()
            for front in range(self.fronts):
                if self._sent_stats[front] != stats:
                    self._send(front, msg.Out([], [], [], stats, self._received[front]))


def run_engine_core(options: dict[str, Any], addresses: msg.Addresses, fronts: int,
                    ready: Connection, verbose: bool = False) -> None:
    """The core process's entry: check that this machine can run ``options`` (before
    anything is fetched or loaded: see ``machine.check_environment``), load the engine
    (each step a :class:`~.messages.Step` on ``ready``), report ready (a CoreInfo) or the
    error that stopped it (a string, one line for an error raised on purpose) on
    ``ready``, then serve until stopped."""
    from asyncinfer.logs import configure_logging

    configure_logging(verbose, "core")
    for sig in (signal.SIGINT, signal.SIGHUP):  # ignored by the ranks it starts, too
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop_loading)  # a fetch's temporary files go with it
    from asyncinfer.models.progress import on_step

    reporter = _Ready(ready)
    on_step(reporter.step)
    try:
        _run(options, addresses, fronts, reporter)
    finally:
        shutil.rmtree(addresses.directory, ignore_errors=True)  # the server may be gone
    # All is closed and flushed: skip the interpreter's teardown (seconds with torch).
    logging.shutdown()
    os._exit(0)


def _stop_loading(signum: int, frame: object) -> None:
    raise SystemExit(0)


class _Ready:
    """The pipe to the server: steps (from any thread) while the core starts, then its
    answer; nothing after that."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.lock, self.open = conn, threading.Lock(), True

    def step(self, text: str) -> None:
        with self.lock:
            if self.open:
                self.conn.send(msg.Step(text))

    def answer(self, answer: msg.CoreInfo | str) -> None:
        with self.lock:
            self.open = False
            self.conn.send(answer)
            self.conn.close()


def _run(options: dict[str, Any], addresses: msg.Addresses, fronts: int,
         ready: _Ready) -> None:
    try:
        from asyncinfer.config import EngineConfig
        from asyncinfer.machine import check_environment

        check_environment(EngineConfig(**options))
        from asyncinfer.api import AsyncEngine

        engine = AsyncEngine(**options)
    except Exception as exc:
        ready.answer(str(exc) if isinstance(exc, AsyncInferError)
                     else f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None
    parent = os.getppid()
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(_serve(engine, addresses, fronts, ready, parent))
    finally:
        loop.close()


async def _serve(engine: Any, addresses: msg.Addresses, fronts: int, ready: _Ready,
                 parent: int) -> None:
    core = EngineCore(engine, addresses, fronts)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, core.stop)

    def orphaned() -> None:
        logger.error("the server process %d is gone; the engine core stops", parent)
        core.stop()

    unwatch = watch_exit(parent, orphaned)
    runner = engine.runner
    ready.answer(msg.CoreInfo(os.getpid(), engine.model_name, engine.config.model,
                              engine.context_len, runner.num_pages, runner.page_size,
                              engine.policy.name, runner.tp.size, str(runner.device),
                              str(runner.dtype).removeprefix("torch."),
                              engine.config.resolved_attention_backend,
                              runner.cpu_threads))
    try:
        await core.run()
    finally:
        unwatch()
    if core.failed:
        raise SystemExit(1)
