"""The KV-cache event publisher: each round's events, as one ``KVEventBatch``, published over
ZeroMQ from a thread of its own, the way vLLM's ZmqEventPublisher does (a PUB socket sending
``[topic, seq as 8 bytes big-endian, msgpack batch]``; a ROUTER socket replaying the last
``buffer_steps`` batches from a sequence number on). The engine's side only queues: a full
queue drops the batch and counts it, so no subscriber, slow or absent, ever slows a round.
See docs/architecture.md, 'KV-cache events'."""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any

import zmq
from attrs import evolve, frozen

from asyncinfer.errors import ConfigError
from asyncinfer.kvcache.events import KVEvent, KVEventBatch, encode_batch

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
"""The sequence number of the replay's last message (its topic and payload empty)."""

_STOP = object()


@frozen
class KVEventsSettings:
    """Where the radix cache's KV-cache events go (``kv_events``): vLLM's KVEventsConfig
    fields, the same defaults. A ``*`` or ``::`` host, or an ipc:// or inproc:// endpoint,
    is bound; another is connected to (as vLLM does)."""

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    data_parallel_rank: int | None = None

    @classmethod
    def parse(cls, text: str) -> KVEventsSettings:
        """A bare endpoint, or vLLM's ``--kv-events-config`` JSON (``enable_kv_cache_events``
        and ``publisher`` "zmq" accepted; another field is refused, named)."""
        import json

        if not text.lstrip().startswith("{"):
            return cls(endpoint=text.strip())
        try:
            fields = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"kv_events: not JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise ConfigError("kv_events: a JSON object or an endpoint")
        if fields.pop("enable_kv_cache_events", True) is not True:
            raise ConfigError("kv_events: enable_kv_cache_events false publishes nothing; "
                              "leave kv_events unset instead")
        if fields.pop("publisher", "zmq") != "zmq":
            raise ConfigError("kv_events: the publisher is zmq")
        known = {a.name for a in cls.__attrs_attrs__}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ConfigError(f"kv_events: unknown field {unknown[0]!r}; known: "
                              f"{', '.join(sorted(known))}")
        rank = fields.get("data_parallel_rank")
        if rank is not None and (not isinstance(rank, int) or rank < 0):
            raise ConfigError(f"kv_events: data_parallel_rank must be >= 0, got {rank!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = fields.get(name, 1)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"kv_events: {name} must be an integer >= 1, got {value!r}")
        for name in ("endpoint", "replay_endpoint", "topic"):
            if name in fields and not isinstance(fields[name], str | None):
                raise ConfigError(f"kv_events: {name} must be a string")
        return cls(**fields)

    def to_json(self) -> str:
        """What :meth:`parse` reads back as these settings."""
        import json

        from attrs import asdict

        return json.dumps(asdict(self))

    def for_replica(self, rank: int) -> KVEventsSettings:
        """Replica ``rank``'s own: a TCP port ``rank`` above (port 0 stays 0), an ipc or
        inproc path with ``_dp{rank}``, and the rank in every batch (vLLM's rule)."""
        return evolve(self, endpoint=_offset(self.endpoint, rank),
                      replay_endpoint=None if self.replay_endpoint is None
                      else _offset(self.replay_endpoint, rank), data_parallel_rank=rank)


def _offset(endpoint: str, rank: int) -> str:
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    head, _, port = endpoint.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return endpoint
    return f"{head}:{int(port) + rank}"



def _binds(endpoint: str) -> bool:
    return ("*" in endpoint or "::" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))


class KVEventPublisher:
    """Publishes batches of KV-cache events for ``settings`` until :meth:`close`."""

    def __init__(self, settings: KVEventsSettings) -> None:
        self.settings = settings
        self.published = 0   # batches sent
        self.dropped = 0     # batches the full queue turned away
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=settings.max_queue_size)
        self._ready = threading.Event()
        self._failure: str | None = None
        self._thread = threading.Thread(target=self._run, name="asyncinfer-kv-events",
                                        daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise ConfigError(f"kv_events: {self._failure}")

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one round's events (nothing where there are none); never blocks."""
        if not events:
            return
        batch = KVEventBatch(time.time(), events, self.settings.data_parallel_rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        """Send what is queued, then stop (at most a few seconds)."""
        while True:
            try:
                self._queue.put(_STOP, timeout=0.1)
                break
            except queue.Full:
                if not self._thread.is_alive():
                    break
        self._thread.join(5.0)

    def _run(self) -> None:
        settings = self.settings
        context = zmq.Context()
        pub = context.socket(zmq.PUB)
        replay = None
        try:
            try:
                pub.set_hwm(settings.hwm)
                (pub.bind if _binds(settings.endpoint) else pub.connect)(settings.endpoint)
                if settings.replay_endpoint is not None:
                    replay = context.socket(zmq.ROUTER)
                    replay.set(zmq.SNDHWM, 2 * (settings.buffer_steps + 1))
                    replay.bind(settings.replay_endpoint)
            except zmq.ZMQError as exc:
                self._failure = f"cannot open {settings.endpoint}: {exc}"
                return
            finally:
                self._ready.set()
            self._serve(pub, replay)
        finally:
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=100)
            context.term()

    def _serve(self, pub: zmq.Socket[bytes], replay: zmq.Socket[bytes] | None) -> None:
        topic = self.settings.topic.encode()
        sent: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=self.settings.buffer_steps)
        seq = 0
        while True:
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                batch = None
            if batch is _STOP:
                return
            if batch is not None:
                payload = encode_batch(batch)
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                sent.append((seq, payload))
                seq += 1
                self.published += 1
            while replay is not None and replay.poll(0):
                self._replay(replay, topic, sent)

    @staticmethod
    def _replay(replay: zmq.Socket[bytes], topic: bytes,
                sent: collections.deque[tuple[int, bytes]]) -> None:
        """Answer ``[client, b"", start seq]`` with every kept batch from ``start`` on, then
        the end marker."""
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kv_events: a replay request of %d frames ignored", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(sent):
            if seq >= start:
                replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))
