"""The engine core behind ZeroMQ and the fronts' EngineClient, in one event loop: the same
tokens as the in-process engine, streams that coalesce, aborts and drains that reach the
core, fronts kept apart, and a core that goes away ending every request with 503's kind."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from asyncinfer.api import AsyncEngine
from asyncinfer.ipc import messages as msg
from asyncinfer.ipc.client import EngineClient
from asyncinfer.ipc.core_process import EngineCore
from asyncinfer.params import SamplingParams
from asyncinfer.tokenizer import Tokenizer
from tests.test_async_engine import greedy, tiny_engine
from tests.test_server_hostile import storm_with_hang_ups


class Served:
    """An EngineCore running in this loop and ``fronts`` clients connected to it."""

    def __init__(self, engine: AsyncEngine, directory: Path, fronts: int,
                 core_pid: int | None = None, tokenizer: Tokenizer | None = None) -> None:
        self.engine = engine
        addresses = msg.Addresses(str(directory))
        self.core = EngineCore(engine, addresses, fronts)
        info = msg.CoreInfo(core_pid or os.getpid(), "m", str(directory), engine.context_len,
                            engine.runner.num_pages)
        self.clients = [EngineClient(info, addresses, i, fronts, tokenizer)
                        for i in range(fronts)]
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Served:
        self.task = asyncio.create_task(self.core.run())
        for client in self.clients:
            await client.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for client in self.clients:
            await client.close()
        self.core.stop()
        assert self.task is not None
        await self.task

    async def counters_arrive(self, client: EngineClient, timeout: float = 30.0) -> None:
        """Until the client's counters are the core's (they arrive between rounds too)."""
        deadline = time.monotonic() + timeout
        while client.stats() != self.engine.stats():
            assert time.monotonic() < deadline, "the core's counters never arrived"
            await asyncio.sleep(0.01)

    async def idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        sched = self.engine.scheduler
        while sched.has_work or sched.in_flight or self.engine.stats().waiting:
            assert time.monotonic() < deadline, "the core never went idle"
            await asyncio.sleep(0.01)


def test_sampling_params_cross_by_field_name() -> None:
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.1,
                            seed=2**64 - 1, stop=("x", "yz"), ignore_eos=True,
                            skip_special_tokens=False, priority=-3, tenant="t")
    add = msg.decode_inbound(msg.encode(msg.Add(1, 2, [3, 4], msg.params_fields(params))))
    assert isinstance(add, msg.Add) and (add.front, add.uid, add.prompt_ids) == (1, 2, [3, 4])
    assert add.params["seed"] == 2**64 - 1 and add.params["tenant"] == "t"
    assert msg.params_from(add.params) == params
    # By name: a field left out is its default, whatever the order of the rest.
    assert msg.params_from({"tenant": "u", "max_tokens": 3}) == SamplingParams(3, tenant="u")
    with pytest.raises(TypeError):
        msg.params_from({"max_tokens": 3, "no_such_field": 1})


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


async def test_two_fronts_get_the_in_process_engines_tokens(tiny_llama_dir: Path,
                                                             tmp_path: Path) -> None:
    batch = prompts(24)
    lengths = [random.Random(i).randrange(1, 20) for i in range(len(batch))]
    async with tiny_engine(tiny_llama_dir, cache_type="naive") as engine:
        expected = [(await engine.generate(p, greedy(n))).token_ids
                    for p, n in zip(batch, lengths)]
    async with Served(tiny_engine(tiny_llama_dir, cache_type="naive"), tmp_path, 2) as served:
        a, b = served.clients
        outputs = await asyncio.gather(*(
            (a if i % 2 else b).generate(p, greedy(n))
            for i, (p, n) in enumerate(zip(batch, lengths))))
        assert [o.token_ids for o in outputs] == expected
        assert all(o.finish_reason == "length" for o in outputs)
        streamed = [d async for d in a.stream(batch[0], greedy(lengths[0]))]
        assert [t for d in streamed for t in d.token_ids] == expected[0]
        assert streamed[-1].output is not None
        assert streamed[-1].output.token_ids == expected[0]
        await served.idle()
        await served.counters_arrive(a)
        stats = a.stats()
        assert stats.kv_pages_used == 0 and stats.waiting == 0 and stats.running == 0
        assert stats == served.engine.stats()
        # Every round is counted, with its host and device-wait seconds.
        assert stats.rounds >= stats.batches_prefill + stats.batches_decode > 0
        assert stats.round_host_seconds > 0 and stats.round_wait_seconds > 0


async def test_a_reader_that_falls_behind_gets_the_tokens_in_one_delta(
        tiny_llama_dir: Path, tmp_path: Path) -> None:
    async with Served(tiny_engine(tiny_llama_dir), tmp_path, 1) as served:
        client = served.clients[0]
        stream = client.stream([5, 6, 7], greedy(30))
        first = await stream.__anext__()
        await served.idle()             # the engine runs to the end; this reader does not
        rest = [d async for d in stream]
        assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 30
        assert any(len(d.token_ids) > 1 for d in rest)
        assert len(rest) < 29


async def test_cancelled_requests_free_their_pages_in_the_core(tiny_llama_dir: Path,
                                                               tmp_path: Path) -> None:
    async with Served(tiny_engine(tiny_llama_dir), tmp_path, 1) as served:
        client = served.clients[0]
        long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
        tasks = [asyncio.create_task(client.generate(p, long)) for p in prompts(6)]
        streams = [client.stream(p, long) for p in prompts(3, seed=9)]
        for stream in streams:
            await stream.__anext__()
        await asyncio.sleep(0.1)
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.aclose()        # the reader went away
        await asyncio.gather(*tasks, return_exceptions=True)
        await served.idle()
        assert served.engine.stats().kv_pages_used == 0
        assert served.engine.stats().running == 0


async def test_abort_all_of_one_front_leaves_the_other_fronts_requests(
        tiny_llama_dir: Path, tmp_path: Path) -> None:
    engine = tiny_engine(tiny_llama_dir, max_seq_len=1024, num_pages=2048)
    async with Served(engine, tmp_path, 2) as served:
        a, b = served.clients
        long = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
        on_a = [a.stream(p, long) for p in prompts(3)]
        on_b = [asyncio.create_task(b.generate(p, greedy(40))) for p in prompts(3, seed=4)]
        for stream in on_a:             # every request of front a is running
            await stream.__anext__()
        a.abort_all()
        ended = []
        for stream in on_a:
            deltas = [d async for d in stream]
            ended.append(deltas[-1].output)
        assert all(o is not None and o.finish_reason == "abort" for o in ended), ended
        assert all(o is not None and len(o.token_ids) < 900 for o in ended)
        finished = await asyncio.gather(*on_b)
        assert [len(o.token_ids) for o in finished] == [40, 40, 40]
        await served.idle()
        assert served.engine.stats().kv_pages_used == 0


async def test_stop_strings_are_matched_in_the_front(smollm2_dir: Path, tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_pretrained(smollm2_dir)
    engine = AsyncEngine(None, dtype="float32", max_running_requests=4, kv_cache_gb=0.25)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    async with engine:
        full = await engine.generate("The capital of France is", params)
    stop = full.text.split()[1]
    async with Served(AsyncEngine(None, dtype="float32", max_running_requests=4,
                                  kv_cache_gb=0.25), tmp_path, 1,
                      tokenizer=tokenizer) as served:
        out = await served.clients[0].generate("The capital of France is",
                                               params.replace(stop=(stop,)))
        assert out.finish_reason == "stop"
        assert out.text == full.text[: full.text.index(stop)]
        await served.idle()
        assert served.engine.stats().running == 0


async def test_requests_in_transit_count_as_waiting(tiny_llama_dir: Path,
                                                    tmp_path: Path) -> None:
    async with Served(tiny_engine(tiny_llama_dir), tmp_path, 1) as served:
        client = served.clients[0]
        tasks = [asyncio.create_task(client.generate(p, greedy(4))) for p in prompts(5)]
        await asyncio.sleep(0)          # sent; the core has not read them yet
        assert client.stats().waiting == 5
        await asyncio.gather(*tasks)
        await served.idle()
        await served.counters_arrive(client)
        assert client.stats().waiting == 0


@pytest.fixture
def stand_in() -> AsyncIterator[subprocess.Popen[bytes]]:
    """A process whose death stands for the core's (the core itself runs in this loop)."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


async def test_a_core_that_dies_ends_every_request_as_unavailable(
        tiny_llama_dir: Path, tmp_path: Path, stand_in: subprocess.Popen[bytes]) -> None:
    async with Served(tiny_engine(tiny_llama_dir), tmp_path, 1,
                      core_pid=stand_in.pid) as served:
        client = served.clients[0]
        exited = asyncio.Event()
        client.on_core_exit(exited.set)
        long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
        whole = asyncio.create_task(client.generate([3, 4, 5], long))
        stream = client.stream([6, 7, 8], long)
        await stream.__anext__()
        assert client.alive
        stand_in.kill()
        await asyncio.wait_for(exited.wait(), 30.0)  # a hang guard, not a timing
        for _ in range(10):             # ended before the exit callbacks ran: a few turns
            if whole.done():
                break
            await asyncio.sleep(0)
        assert whole.done()
        out = whole.result()
        assert (out.finish_reason, out.error_kind) == ("error", "unavailable")
        assert len(out.token_ids) < 100
        last = [d async for d in stream][-1]
        assert last.output is not None and last.output.error_kind == "unavailable"
        assert not client.alive
        late = await client.generate([1, 2], greedy(2))
        assert (late.finish_reason, late.error_kind) == ("error", "unavailable")


async def test_http_hang_ups_and_the_drain_reach_the_core(smollm2_dir: Path,
                                                          tmp_path: Path) -> None:
    """The HTTP app served from an EngineClient: 60 streams, every third hung up after its
    first chunk, the rest read to [DONE]; then streams still running when the drain's
    timeout passes end with an "abort" chunk. Each time the core lets go of everything."""
    from aiohttp.test_utils import TestClient, TestServer

    from asyncinfer.server import create_app
    from asyncinfer.server.operations import drain

    engine = AsyncEngine(None, dtype="float32", max_running_requests=16, kv_cache_gb=0.25)
    tokenizer = Tokenizer.from_pretrained(smollm2_dir)
    async with Served(engine, tmp_path, 1, tokenizer=tokenizer) as served:
        app = create_app(served.clients[0], served_model_name="m")
        async with TestClient(TestServer(app)) as http:
            await storm_with_hang_ups(http, 60, max_tokens=8)
            await served.idle()
            assert served.engine.stats().kv_pages_used == 0

            long = {"prompt": "Count: 1, 2,", "max_tokens": 1000, "ignore_eos": True,
                    "stream": True}
            streams = [await http.post("/v1/completions", json=long) for _ in range(3)]
            for stream in streams:
                await stream.content.readline()
            assert await drain(app, 0.2) is False
            for stream in streams:
                events = [e for e in (await stream.text()).split("\n\n") if e]
                assert events[-1] == "data: [DONE]"
                assert '"finish_reason": "abort"' in events[-2]
            await served.idle()
            stats = served.engine.stats()
            assert (stats.running, stats.waiting, stats.kv_pages_used) == (0, 0, 0)


async def test_a_request_sent_as_start_returns_gets_its_answer(tiny_llama_dir: Path,
                                                               tmp_path: Path) -> None:
    """The core drops what it sends a front whose socket has not joined yet; start() waits
    for the core's answer to a Hello, so a request refused at once still gets its end."""
    engine = tiny_engine(tiny_llama_dir)
    addresses = msg.Addresses(str(tmp_path))
    core = EngineCore(engine, addresses, 1)
    task = asyncio.create_task(core.run())
    info = msg.CoreInfo(os.getpid(), "m", str(tmp_path), engine.context_len,
                        engine.runner.num_pages)
    bad = SamplingParams(max_tokens=2, stop_token_ids=[10**6])
    try:
        for _ in range(8):   # a fresh connection each time
            client = EngineClient(info, addresses, 0, 1)
            await client.start()
            out = await asyncio.wait_for(client.generate([5, 6], bad), 30.0)  # hang guard
            assert (out.finish_reason, out.error_kind) == ("error", "invalid")
            await client.close()
    finally:
        core.stop()
        await task


async def test_start_without_a_core_is_an_error_naming_it(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    from asyncinfer.errors import EngineError
    from asyncinfer.ipc import client as client_module

    monkeypatch.setattr(client_module, "HELLO_TIMEOUT", 0.3)
    info = msg.CoreInfo(os.getpid(), "m", str(tmp_path), 128, 16)
    client = EngineClient(info, msg.Addresses(str(tmp_path)), 0, 1)
    with pytest.raises(EngineError, match="did not answer"):
        await client.start()
    await client.close()
