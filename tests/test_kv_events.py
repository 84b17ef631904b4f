"""KV-cache events (``kv_events``) in vLLM's schema: the structs read bytes vLLM's own classes
wrote and hash pages as vLLM does; a subscriber over ZeroMQ rebuilds from them exactly the
pages the radix cache holds, through stores, evictions and a flush; the replay socket
answers as vLLM's does; a full queue drops batches and counts them, never blocking."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from asyncinfer.engine.kv_publisher import END_OF_REPLAY, KVEventPublisher, KVEventsSettings
from asyncinfer.errors import ConfigError
from asyncinfer.kvcache import events as ev
from asyncinfer.kvcache.radix import Node
from tests.test_async_engine import greedy, tiny_engine

# Encoded by vLLM 0.34.0's own classes (vllm.distributed.kv_events: KVEventBatch with
# BlockStored, BlockStored, BlockRemoved, AllBlocksCleared; ts 1.5, data_parallel_rank 1),
# its hashes from vllm.utils.hashing.sha256 chained as vllm.v1.core.kv_cache_utils does
# (NONE_HASH from the seed "vllm-none-hash"), made int as vLLM's events carry them.
VLLM_BATCH = bytes.fromhex(
    "93cb3ff800000000000094de0008a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
    "93cf1a1eb4e3edd9361acfd41bc1f76b956ddecf5f3971065b56d691b1706172656e745f626c6f636b5f6861"
    "7368c0a9746f6b656e5f6964739c0102030405060708090a0b0caa626c6f636b5f73697a6504a76c6f72615f"
    "6964c0a66d656469756da3435055a96c6f72615f6e616d65c0de0008a474797065ab426c6f636b53746f7265"
    "64ac626c6f636b5f68617368657391cfc76fb3ed83367eebb1706172656e745f626c6f636b5f68617368cfd4"
    "1bc1f76b956ddea9746f6b656e5f6964739414151617aa626c6f636b5f73697a6504a76c6f72615f6964c0a6"
    "6d656469756da3435055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f766564ac626c6f"
    "636b5f68617368657391cf5f3971065b56d691a66d656469756da343505581a474797065b0416c6c426c6f63"
    "6b73436c656172656401")
VLLM_HASHES = [1882140585328457242, 15284023028817948126, 6861639779391821457]
VLLM_CHILD = 14370902768652549867   # [20, 21, 22, 23] after the second page


def _chain(tokens: list[int], size: int, parent: bytes | None = None) -> list[bytes]:
    out = []
    for i in range(0, len(tokens) - len(tokens) % size, size):
        parent = ev.page_hash(parent, tokens[i:i + size])
        out.append(parent)
    return out


def test_pages_hash_as_vllm_hashes_them() -> None:
    pages = _chain(list(range(1, 13)), 4)
    assert [ev.external(h) for h in pages] == VLLM_HASHES
    assert ev.external(ev.page_hash(pages[1], [20, 21, 22, 23])) == VLLM_CHILD


def test_vllm_bytes_decode_into_our_structs_and_ours_into_the_same_values() -> None:
    ours = ev.KVEventBatch(1.5, [
        ev.BlockStored(VLLM_HASHES, None, list(range(1, 13)), 4, None, "CPU", None),
        ev.BlockStored([VLLM_CHILD], VLLM_HASHES[1], [20, 21, 22, 23], 4, None, "CPU", None),
        ev.BlockRemoved([VLLM_HASHES[2]], "CPU"), ev.AllBlocksCleared()], 1)
    assert ev.decode_batch(VLLM_BATCH) == ours
    # Byte for byte but for msgpack's choice of map header: the same values.
    assert msgspec.msgpack.decode(ev.encode_batch(ours)) == msgspec.msgpack.decode(VLLM_BATCH)


class Subscriber:
    """What a router keeps: the pages each stored event names, less those removed; every
    batch checked to follow the one before (sequence numbers) and chained by hash."""

    def __init__(self, endpoint: str, topic: str = "", bind: bool = False) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        (self.sub.bind if bind else self.sub.connect)(endpoint)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.pages: dict[int, tuple[int, ...]] = {}   # hash -> its page's tokens
        self.seq = -1
        self.batches: list[ev.KVEventBatch] = []

    def drain(self, until: Any, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, "the awaited events never came"
            if not self.sub.poll(50):
                continue
            _, seq, payload = self.sub.recv_multipart()
            number = int.from_bytes(seq, "big")
            assert number == self.seq + 1 or self.seq == -1, (number, self.seq)
            self.seq = number
            batch = ev.decode_batch(payload)
            self.batches.append(batch)
            for event in batch.events:
                self.apply(event)

    def apply(self, event: ev.KVEvent) -> None:
        if isinstance(event, ev.AllBlocksCleared):
            self.pages.clear()
        elif isinstance(event, ev.BlockRemoved):
            for h in event.block_hashes:
                del self.pages[h]
        else:
            size = event.block_size
            assert event.parent_block_hash is None or event.parent_block_hash in self.pages
            for i, h in enumerate(event.block_hashes):
                self.pages[h] = tuple(event.token_ids[i * size:(i + 1) * size])

    def close(self) -> None:
        self.sub.close(linger=0)
        self.context.term()


def _cached(node: Node, parent: bytes | None = None) -> dict[int, tuple[int, ...]]:
    """The radix cache's pages: hash (recomputed from the tokens) -> tokens."""
    out = {}
    for child in node.children.values():
        digest = parent
        for chunk in child.chunks:
            digest = ev.page_hash(digest, chunk)
            out[ev.external(digest)] = chunk
        out.update(_cached(child, digest))
    return out


async def test_a_subscriber_rebuilds_the_cached_pages_through_stores_evictions_and_a_flush(
        tiny_llama_dir: Path, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path / 'kv'}"
    subscriber = Subscriber(endpoint)
    try:
        # 48 pages of 4 tokens: the prompts below do not all fit, so pages get evicted.
        async with tiny_engine(tiny_llama_dir, num_pages=48, max_running_requests=4,
                               kv_events=endpoint) as engine:
            cache = engine.scheduler.kv.prefix
            shared = list(range(3, 35))
            prompts = [shared + [100 + i] * (5 + i) for i in range(4)]
            prompts += [list(range(200 + 40 * i, 237 + 40 * i)) for i in range(4)]
            await asyncio.sleep(0.2)  # the SUB socket joins (a PUB sends to who is there)
            for prompt in prompts:
                await engine.generate(prompt, greedy(6))
                subscriber.drain(lambda: subscriber.pages == _cached(cache.root))
            assert any(isinstance(e, ev.BlockRemoved) for b in subscriber.batches
                       for e in b.events), "nothing was evicted"
            assert len(subscriber.pages) == cache.cached_pages > 0
            done = await engine.flush_cache()
            assert done.held_pages == 0
            subscriber.drain(lambda: isinstance(subscriber.batches[-1].events[-1],
                                                ev.AllBlocksCleared))
            assert subscriber.pages == {}
            stats = engine.stats()
            assert isinstance(subscriber.batches[0].events[0], ev.AllBlocksCleared)
            assert stats.kv_event_batches == len(subscriber.batches)
            assert stats.kv_event_batches_dropped == 0
    finally:
        subscriber.close()


def test_the_replay_socket_resends_from_a_sequence_number_then_says_the_end(
        tmp_path: Path) -> None:
    """A DEALER asks from sequence number 3 as vLLM's replay clients do (an empty frame,
    then 8 bytes big-endian); it gets the kept batches from 3 on, then the end marker."""
    settings = KVEventsSettings(endpoint=f"ipc://{tmp_path / 'pub'}",
                                replay_endpoint=f"ipc://{tmp_path / 'replay'}",
                                topic="kv@pod@model", buffer_steps=3)
    publisher = KVEventPublisher(settings)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    try:
        for i in range(5):
            publisher.publish([ev.BlockRemoved([i], "CPU")])
        deadline = time.monotonic() + 30
        while publisher.published < 5:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert settings.replay_endpoint is not None
        dealer.connect(settings.replay_endpoint)
        dealer.send_multipart((b"", (3).to_bytes(8, "big")))
        got = []
        while True:
            assert dealer.poll(30_000), "no replay"
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_OF_REPLAY:
                assert (topic, payload) == (b"", b"")
                break
            assert topic == b"kv@pod@model"
            (event,) = ev.decode_batch(payload).events
            assert isinstance(event, ev.BlockRemoved)
            got.append((int.from_bytes(seq, "big"), event.block_hashes))
        assert got == [(3, [3]), (4, [4])]   # 0 .. 1 fell out of the 3 kept; 2 is before 3
    finally:
        dealer.close(linger=0)
        context.term()
        publisher.close()


def test_a_full_queue_drops_batches_and_counts_them_without_blocking(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The publishing thread held on its first batch (as by a socket that cannot take
    more): two batches fill the queue, the next five are dropped and counted at once, and
    once the thread goes on, what was queued goes out."""
    import threading

    from asyncinfer.engine import kv_publisher

    held, taken = threading.Event(), threading.Event()

    def slow_encode(batch: ev.KVEventBatch) -> bytes:
        taken.set()
        held.wait(30)
        return ev.encode_batch(batch)

    monkeypatch.setattr(kv_publisher, "encode_batch", slow_encode)
    publisher = KVEventPublisher(KVEventsSettings(endpoint=f"ipc://{tmp_path / 'pub'}",
                                                  max_queue_size=2))
    try:
        publisher.publish([ev.BlockRemoved([0], "CPU")])
        assert taken.wait(30)
        for i in range(1, 8):
            publisher.publish([ev.BlockRemoved([i], "CPU")])
        assert (publisher.dropped, publisher.published) == (5, 0)
        held.set()
        deadline = time.monotonic() + 30
        while publisher.published < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        held.set()
        publisher.close()


@pytest.mark.parametrize(("text", "why"), [
    ('{"endpoint": "tcp://*:5557", "publisher": "kafka"}', "publisher is zmq"),
    ('{"enpoint": "tcp://*:5557"}', "unknown field 'enpoint'"),
    ('{"hwm": 0}', "hwm must be an integer >= 1"),
    ('{"enable_kv_cache_events": false}', "publishes nothing"),
    ("{not json", "not JSON"),
])
def test_a_bad_kv_events_config_is_refused_naming_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        KVEventsSettings.parse(text)


def test_vllm_style_config_and_replicas_ports() -> None:
    settings = KVEventsSettings.parse('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                      '"endpoint": "tcp://*:6000", "replay_endpoint": '
                                      '"tcp://*:7000", "topic": "kv@a@b"}')
    one = settings.for_replica(1)
    assert (one.endpoint, one.replay_endpoint, one.data_parallel_rank) == (
        "tcp://*:6001", "tcp://*:7001", 1)
    assert KVEventsSettings.parse(one.to_json()) == one
    assert KVEventsSettings.parse("ipc:///tmp/kv").for_replica(2).endpoint == "ipc:///tmp/kv_dp2"


def test_kv_events_without_the_radix_cache_or_malformed_is_refused_before_loading(
        tiny_llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match="needs the radix cache"):
        tiny_engine(tiny_llama_dir, cache_type="naive", kv_events="ipc:///tmp/never")
    with pytest.raises(ConfigError, match="unknown field 'port'"):
        tiny_engine(tiny_llama_dir, kv_events='{"port": 5557}')


def test_each_data_parallel_replica_publishes_on_its_own_endpoint_with_its_rank() -> None:
    """`serve --dp N --kv-events ...`: replica i's serve arguments carry settings a port i
    above, with data_parallel_rank i (vLLM's rule for its replicas)."""
    from asyncinfer.cli import build_parser
    from asyncinfer.server.replicas import _replica_args

    args = build_parser().parse_args(
        ["serve", "--model", "m", "--dp", "2",
         "--kv-events", '{"endpoint": "tcp://*:6000", "topic": "kv@a@m"}'])
    mine = [KVEventsSettings.parse(_replica_args(args, i, 1, 9000 + i).kv_events)
            for i in range(2)]
    assert [(s.endpoint, s.data_parallel_rank, s.topic) for s in mine] == [
        ("tcp://*:6000", 0, "kv@a@m"), ("tcp://*:6001", 1, "kv@a@m")]


async def test_with_two_tensor_parallel_ranks_rank_0_alone_publishes(
        tiny_llama_dir: Path) -> None:
    """The subscriber binds and the engine connects, so a second publishing rank would
    reach it too: its sequence numbers would start again. One stream arrives, and it rebuilds
    rank 0's cache."""
    context = zmq.Context()
    probe = context.socket(zmq.REP)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)
    context.term()
    endpoint = f"tcp://127.0.0.1:{port}"
    subscriber = Subscriber(endpoint, bind=True)
    try:
        async with tiny_engine(tiny_llama_dir, tensor_parallel_size=2,
                               kv_events=endpoint) as engine:
            cache = engine.scheduler.kv.prefix
            # The PUB socket connects; the bound SUB sends it the subscription only once it
            # has handled the connection, which it does when polled.
            for _ in range(10):
                subscriber.sub.poll(20)
                await asyncio.sleep(0.02)
            for i in range(3):
                await engine.generate(list(range(3, 20)) + [50 + i] * 6, greedy(4))
            subscriber.drain(lambda: subscriber.pages == _cached(cache.root) != {})
            await asyncio.sleep(0.3)  # a second stream, if any, would have come by now
            subscriber.drain(lambda: not subscriber.sub.poll(0))
            assert engine.stats().kv_event_batches == subscriber.seq + 1
    finally:
        subscriber.close()
