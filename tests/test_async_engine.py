"""AsyncEngine: concurrency, streaming, cancellation, a responsive event loop, overlap."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import pytest

from asyncinfer.api import AsyncEngine
from asyncinfer.params import SamplingParams


def tiny_engine(model_dir: Path, **options: object) -> AsyncEngine:
    defaults: dict[str, object] = {"dtype": "float32", "page_size": 4,
                                   "max_running_requests": 16, "num_pages": 256,
                                   "max_seq_len": 128, "max_extend_tokens": 64}
    return AsyncEngine(str(model_dir), skip_tokenizer_init=True, **{**defaults, **options})


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def wait_idle(engine: AsyncEngine, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.scheduler.has_work or engine.scheduler.in_flight:
        assert time.monotonic() < deadline, "engine never went idle"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
async def test_concurrent_generate_equals_one_at_a_time(tiny_llama_dir: Path,
                                                        overlap: bool) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))] for _ in range(50)]
    lengths = [rng.randrange(1, 24) for _ in prompts]
    async with tiny_engine(tiny_llama_dir, overlap=overlap, cache_type="naive") as engine:
        alone = [(await engine.generate(p, greedy(n))).token_ids
                 for p, n in zip(prompts, lengths)]
        together = await asyncio.gather(*(engine.generate(p, greedy(n))
                                          for p, n in zip(prompts, lengths)))
        assert [o.token_ids for o in together] == alone
        await wait_idle(engine)
        assert engine.stats().kv_pages_used == 0


async def test_stream_deltas_concatenate_to_the_final_text(smollm2_dir: Path) -> None:
    async with AsyncEngine(None, dtype="float32", max_running_requests=4) as engine:
        deltas = [d async for d in engine.stream("Once upon a time,", greedy(24))]
        final = deltas[-1].output
        assert final is not None and final.finish_reason == "length"
        assert "".join(d.text for d in deltas) == final.text
        assert [t for d in deltas for t in d.token_ids] == final.token_ids
        assert len(final.token_ids) == 24


async def test_cancelled_request_is_aborted_and_frees_its_pages(tiny_llama_dir: Path) -> None:
    async with tiny_engine(tiny_llama_dir, cache_type="naive") as engine:
        started = asyncio.Event()

        async def long_request() -> None:
            async for _ in engine.stream([7] * 20, greedy(100)):
                started.set()

        task = asyncio.create_task(long_request())
        await asyncio.wait_for(started.wait(), 30)
        assert engine.stats().running == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_idle(engine)
        stats = engine.stats()
        assert (stats.running, stats.waiting, stats.kv_pages_used) == (0, 0, 0)
        assert len(engine.scheduler.free_rows) == engine.runner.max_rows


async def test_event_loop_stays_responsive_during_generation(tiny_llama_dir: Path) -> None:
    """Every batch waits, in its worker thread, until the loop has run two more ticks: a
    loop blocked while a batch computes would never let one finish."""
    import threading

    engine = tiny_engine(tiny_llama_dir)
    launch = engine.runner.launch
    ticks = [0]
    served: list[bool] = []

    def gated(batch):
        wait = launch(batch)

        def after_two_ticks():
            seen = ticks[0]
            advanced = threading.Event()

            def watch() -> None:
                while ticks[0] < seen + 2:
                    time.sleep(0.001)
                advanced.set()

            threading.Thread(target=watch, daemon=True).start()
            served.append(advanced.wait(30.0))
            return wait()

        return after_two_ticks

    engine.runner.launch = gated  # type: ignore[method-assign]
    async with engine:
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                await asyncio.sleep(0.001)
                ticks[0] += 1

        tick = asyncio.create_task(ticker())
        out = await engine.generate([5, 6, 7], greedy(12))
        stop.set()
        await tick
        stats = engine.stats()
    assert len(out.token_ids) == 12
    assert len(served) == stats.batches_prefill + stats.batches_decode >= 12
    assert all(served)


async def test_close_fails_requests_still_running(tiny_llama_dir: Path) -> None:
    engine = tiny_engine(tiny_llama_dir)
    launch = engine.runner.launch

    def paced(batch):  # 10 ms a batch: the request is mid-run when close() comes
        wait = launch(batch)

        def slow():
            time.sleep(0.01)
            return wait()

        return slow

    engine.runner.launch = paced  # type: ignore[method-assign]
    await engine.start()
    task = asyncio.create_task(engine.generate([5] * 10, greedy(110)))
    await asyncio.sleep(0.2)
    assert not task.done()
    await engine.close()
    out = await asyncio.wait_for(task, 10)
    assert out.finish_reason == "error" and out.error is not None
    assert out.error_kind == "engine" and not engine.alive


async def test_observed_rounds_account_for_every_batch(tiny_llama_dir: Path) -> None:
    async with tiny_engine(tiny_llama_dir) as engine:
        rounds: list[Any] = []
        engine.observe_rounds(rounds.append)
        await asyncio.gather(*(engine.generate([5, 6, 7 + i], greedy(4)) for i in range(3)))
        await wait_idle(engine)
        engine.observe_rounds(None)
        batches = [r for r in rounds if r.phase]
        # One prefill of all three, then three decode steps of three rows each.
        assert [(r.phase, r.size) for r in batches] == [
            ("prefill", 3), ("decode", 3), ("decode", 3), ("decode", 3)]
        assert all(r.host_s >= 0 and r.wait_s >= 0 for r in rounds)
        assert [r.start for r in rounds] == sorted(r.start for r in rounds)
        seen = len(rounds)
        await engine.generate([5, 6], greedy(2))
        assert len(rounds) == seen, "a removed observer is not called"


def test_freeze_gc_takes_the_start_up_heap_out_of_collections(tiny_llama_dir: Path) -> None:
    import gc

    gc.unfreeze()
    try:
        tiny_engine(tiny_llama_dir)  # CPU: not frozen unless asked
        assert gc.get_freeze_count() == 0
        engine = tiny_engine(tiny_llama_dir, freeze_gc=True)
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # torch, transformers and the engine itself
        assert all(gc.is_tracked(o) for o in (engine.scheduler, engine.runner))
        gc.collect()
        # A collection leaves the frozen heap alone: the engine's objects stay out of the
        # collector's generations, and the frozen count does not fall by a collection's
        # worth (a few frozen objects may still die by reference count, freed by threads
        # that earlier tests in this process left running).
        tracked = {id(o) for o in gc.get_objects()}
        assert id(engine.scheduler) not in tracked and id(engine.runner) not in tracked
        assert frozen - 100 <= gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()

