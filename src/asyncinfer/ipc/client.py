"""The front's side: :class:`EngineClient`, an engine core in another process as the
``Engine`` the HTTP app serves. Detokenizing and stop strings run here, in the front.
If the core's process exits, every open request ends with ``error_kind`` "unavailable"."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable

import attrs
import zmq
import zmq.asyncio

from asyncinfer.core import Event
from asyncinfer.errors import EngineError
from asyncinfer.ipc import messages as msg
from asyncinfer.outputs import CacheFlush, Channel, EngineStats, Front
from asyncinfer.params import SamplingParams
from asyncinfer.processes import watch_exit
from asyncinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

HELLO_INTERVAL = 0.05   # seconds between Hellos until the core's first answer
HELLO_TIMEOUT = 120.0   # a core that stays silent this long is not serving


class EngineClient(Front):
    """Front ``front`` of ``fronts``, talking to the core described by ``info``.

    Request ids are ``front + fronts * n``: unique across fronts without asking anyone.
    Use ``async with`` (or :meth:`start` and :meth:`close`) on the front's event loop.
    """

    def __init__(self, info: msg.CoreInfo, addresses: msg.Addresses, front: int = 0,
                 fronts: int = 1, tokenizer: Tokenizer | None = None) -> None:
        self.info = info
        self.model_name = info.model_name
        self.context_len = info.context_len
        self.tokenizer = tokenizer
        self.front, self.fronts = front, fronts
        self._addresses = addresses
        self._uids = itertools.count(front, fronts)
        self._channels: dict[int, Channel] = {}
        self._stats = EngineStats(0, 0, 0, info.kv_pages_total, 0, 0)
        self._sent = 0                 # Adds sent
        self._received = 0             # of which the core has taken
        self._gone: str | None = None  # why the core can no longer answer
        self._exit_callbacks: list[Callable[[], None]] = []
        self._flushes: dict[int, asyncio.Future[CacheFlush]] = {}
        self._tickets = itertools.count()
        self._ctx: zmq.asyncio.Context | None = None
        self._push: zmq.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._unwatch: Callable[[], None] | None = None
        self._heard = asyncio.Event()   # the core's first Out has arrived

    async def start(self) -> None:
        """Connect to the core and start reading its messages."""
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        self._push = self._sync_ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 1000)
        self._push.connect(self._addresses.inbound)
        pull = self._ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVHWM, 0)
        pull.connect(self._addresses.outbound(self.front))
        self._task = asyncio.create_task(self._read(pull), name="asyncinfer-front-in")
        self._unwatch = watch_exit(self.info.pid, self._core_exited)
        await self._joined()

    async def _joined(self) -> None:
        """Until the core has answered a Hello: before its socket to this front is joined,
        what it sends here is dropped, a request's end with it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HELLO_TIMEOUT
        while not self._heard.is_set() and self._gone is None:
            if loop.time() > deadline:
                raise EngineError(f"the engine core (pid {self.info.pid}) did not answer "
                                  f"within {HELLO_TIMEOUT:.0f} s")
            self._send(msg.Hello(self.front))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._heard.wait(), HELLO_INTERVAL)

    async def close(self) -> None:
        """Stop reading; requests still open end with "abort"."""
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        self._end_all("abort", None, None)
        for future in self._flushes.values():
            if not future.done():
                future.set_exception(EngineError("the engine client is closed"))
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._push is not None:
            self._push.close()
            self._sync_ctx.term()
            self._push = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def __aenter__(self) -> EngineClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def alive(self) -> bool:
        """True while the core's process runs and this client is started."""
        return self._task is not None and self._gone is None

    def stats(self) -> EngineStats:
        """The core's last counters; Adds it has not taken yet count as waiting."""
        in_transit = self._sent - self._received
        return self._stats if not in_transit else attrs.evolve(
            self._stats, waiting=self._stats.waiting + in_transit)

    def abort_all(self) -> None:
        """End this front's open requests now with "abort"; the core frees them."""
        self._end_all("abort", None, None)
        self._send(msg.AbortAll(self.front))

    def shutdown_core(self) -> None:
        """Ask the core to end what is open and stop (the server does, after its fronts)."""
        self._send(msg.Shutdown())

    async def flush_cache(self) -> CacheFlush:
        """Ask the core to empty its prefix cache of the pages no running request holds;
        EngineError where it cannot (the core gone, or its engine stopped)."""
        if self._gone is not None or self._task is None:
            raise EngineError(self._gone or "the engine client is not started")
        ticket = next(self._tickets)
        future = self._flushes[ticket] = asyncio.get_running_loop().create_future()
        self._send(msg.FlushCache(self.front, ticket))
        try:
            return await future
        finally:
            self._flushes.pop(ticket, None)

    def on_core_exit(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the loop) once the core's process has exited (soon, where it
        has already)."""
        if self._gone is not None:
            asyncio.get_running_loop().call_soon(callback)
        self._exit_callbacks.append(callback)

    def new_uid(self) -> int:
        return next(self._uids)

    def submit(self, uid: int, prompt_ids: list[int], params: SamplingParams,
               channel: Channel) -> None:
        """Send a request to the core (or, with no core to answer, end it "unavailable")."""
        if self._gone is not None or self._task is None:
            channel.put_nowait(Event(uid, None, "error",
                                     self._gone or "the engine client is not started",
                                     error_kind="unavailable"))
            return
        # Encoded before anything counts it: a request that cannot be sent holds no place.
        data = msg.encode(msg.Add(self.front, uid, prompt_ids, msg.params_fields(params)))
        self._channels[uid] = channel
        self._sent += 1
        self._send_bytes(data)

    def abort(self, uid: int) -> None:
        """Stop a request; the core frees what it holds."""
        if self._channels.pop(uid, None) is not None:
            self._send(msg.Abort([uid]))

    def _send(self, message: msg.Inbound) -> None:
        self._send_bytes(msg.encode(message))

    def _send_bytes(self, data: bytes) -> None:
        if self._push is None or self._gone is not None:
            return
        self._push.send(data, flags=zmq.NOBLOCK)

    async def _read(self, pull: zmq.asyncio.Socket) -> None:
        try:
            while True:
                data = await pull.recv()
                self._heard.set()
                self._apply(msg.decode_out(data))
        finally:
            pull.close(linger=0)

    def _apply(self, out: msg.Out) -> None:
        self._stats, self._received = out.stats, out.received
        for answer in out.flushed:
            future = self._flushes.get(answer.ticket)
            if future is not None and not future.done():
                if answer.error is None:
                    future.set_result(CacheFlush(answer.freed_pages, answer.held_pages))
                else:
                    future.set_exception(EngineError(answer.error))
        channels = self._channels
        for scored in out.prompts:
            channel = channels.get(scored.uid)
            if channel is not None:
                channel.put_nowait(Event(scored.uid, None, prompt_logprobs=tuple(
                    None if e is None else e.core() for e in scored.entries)))
        logprobs = dict(out.logprobs) if out.logprobs else None
        for i, (uid, token) in enumerate(zip(out.uids, out.tokens)):
            channel = channels.get(uid)
            if channel is not None:
                logprob = logprobs.get(i) if logprobs is not None else None
                channel.put_nowait(Event(uid, token, logprob=None if logprob is None
                                         else logprob.core()))
        for end in out.ends:
            channel = channels.pop(end.uid, None)
            if channel is not None:
                channel.put_nowait(end.event())

    def _core_exited(self) -> None:
        self._gone = f"the engine core (pid {self.info.pid}) has stopped"
        logger.error("%s; ending %d open requests", self._gone, len(self._channels))
        self._end_all("error", self._gone, "unavailable")
        for future in self._flushes.values():
            if not future.done():
                future.set_exception(EngineError(self._gone))
        for callback in self._exit_callbacks:
            callback()

    def _end_all(self, reason: str, error: str | None, kind: str | None) -> None:
        end = msg.End(0, reason, error, kind)
        for uid in list(self._channels):
            end.uid = uid
            self._channels.pop(uid).put_nowait(end.event())
