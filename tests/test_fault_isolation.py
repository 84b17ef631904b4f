"""One request can never harm another: a failed batch, a dead loop, extreme sampling values.

A real tiny model runs behind a runner whose launch fails on command: whenever the batch
holds a poisoned prompt (one with the MARKER token), or once at its n-th launch. A failure
raises at the launch, or in the wait after the forward ran, having written garbage KV and a
wrong token for its rows first (what a real fault could leave behind). Requests in a failed
batch must finish with exactly the tokens of a fault-free run (greedy and seeded alike); only
a request whose batch fails with it alone ends in error, of kind "engine"; and afterwards the
engine holds nothing but its prefix cache.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from asyncinfer.api import AsyncEngine, RequestOutput
from asyncinfer.core import Batch, ForwardOutput
from asyncinfer.engine.runner import ModelRunner
from asyncinfer.params import SamplingParams

MARKER = 499
TIMEOUT = 60.0

_rng = random.Random(3)
PROMPTS = [[_rng.randrange(3, 400) for _ in range(n)] for n in (9, 17, 6)]
POISONED = [5, 6, MARKER, 7, 8, 9]


def tiny_engine(model_dir: Path, **options: object) -> AsyncEngine:
    defaults: dict[str, object] = {"dtype": "float32", "page_size": 4,
                                   "max_running_requests": 8, "num_pages": 128,
                                   "max_seq_len": 128, "max_extend_tokens": 64,
                                   "cache_type": "radix"}
    return AsyncEngine(str(model_dir), skip_tokenizer_init=True, **{**defaults, **options})


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def seeded(n: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.8, top_p=0.95, seed=seed,
                          ignore_eos=True)


class FaultyRunner:
    """Makes a runner's launch fail: for a batch holding a poisoned prompt, and once for the
    ``fail_at``-th launch. ``where`` is "launch" (the launch raises) or "forward" (the forward
    runs, garbage is written over what it wrote, and the wait raises)."""

    def __init__(self, runner: ModelRunner, where: str, fail_at: int | None = None) -> None:
        self.runner, self.where, self.fail_at = runner, where, fail_at
        self.real = runner.launch
        self.launched: list[Batch] = []
        self.failed: list[Batch] = []
        runner.launch = self.launch

    @property
    def launches(self) -> int:
        return len(self.launched)

    def launch(self, batch: Batch) -> Callable[[], ForwardOutput]:
        self.launched.append(batch)
        if not (self._poisoned(batch) or self.launches == self.fail_at):
            return self.real(batch)
        self.failed.append(batch)
        if self.where == "launch":
            raise RuntimeError("injected launch fault")
        wait = self.real(batch)

        def fail() -> ForwardOutput:
            wait()
            self._corrupt(batch)
            raise RuntimeError("injected forward fault")

        return fail

    def _poisoned(self, batch: Batch) -> bool:
        pool = self.runner.token_pool
        return any(bool((pool[row, :end] == MARKER).any())
                   for row, end in zip(batch.rows, batch.ends))

    def _corrupt(self, batch: Batch) -> None:
        """Garbage KV where the batch wrote, and a wrong sampled token (finite values: a
        freed slot's stale NaN would leak through masked attention, which no fault here
        is about)."""
        runner = self.runner
        for row, start, end in zip(batch.rows, batch.starts, batch.ends):
            slots = runner.page_table[row, start:end]
            runner.pool.k[:, slots] = 7.0
            runner.pool.v[:, slots] = -7.0
            runner.token_pool[row, end] = 3


def record_preemptions(engine: AsyncEngine) -> list[int]:
    """From now on, the number of outputs each preempted request had, one per preemption."""
    sched = engine.scheduler
    real = sched.preempt
    outputs: list[int] = []

    def preempt(uid: int) -> bool:
        req = sched.running.get(uid) or next((r for r in sched.waiting if r.uid == uid), None)
        outputs.append(len(req.output_ids) if req is not None else -1)
        return real(uid)

    sched.preempt = preempt
    return outputs


async def run_all(engine: AsyncEngine, prompts: Sequence[list[int]],
                  params: Sequence[SamplingParams], stream: Sequence[bool] | None = None
                  ) -> list[RequestOutput]:
    """Run the requests concurrently, some through ``stream`` and the rest ``generate``."""
    async def streamed(prompt: list[int], p: SamplingParams) -> RequestOutput:
        output = None
        async for delta in engine.stream(prompt, p):
            output = delta.output
        assert output is not None
        return output

    kinds = stream or [i % 2 == 1 for i in range(len(prompts))]
    calls = [streamed(x, p) if s else engine.generate(x, p)
             for x, p, s in zip(prompts, params, kinds)]
    return await asyncio.wait_for(asyncio.gather(*calls), TIMEOUT)


async def fault_free(model_dir: Path, prompts: Sequence[list[int]],
                     params: Sequence[SamplingParams]) -> list[list[int]]:
    async with tiny_engine(model_dir) as engine:
        return [o.token_ids for o in await run_all(engine, prompts, params)]


async def assert_clean(engine: AsyncEngine) -> None:
    await asyncio.wait_for(engine.wait_idle(), TIMEOUT)
    sched = engine.scheduler
    sched.check_invariants()
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv_pages_used) == (0, 0, 0)
    assert len(sched.free_rows) == engine.runner.max_rows and not sched._suspects
    assert engine.alive


@pytest.mark.parametrize("where", ["launch", "forward"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
async def test_a_poisoned_request_fails_alone_and_the_others_are_untouched(
        tiny_llama_dir: Path, where: str, overlap: bool) -> None:
    params = [greedy(n) for n in (10, 14, 8)]
    long_params = [greedy(n) for n in (60, 50, 70)]
    expected = await fault_free(tiny_llama_dir, PROMPTS, params)
    expected_long = await fault_free(tiny_llama_dir, PROMPTS, long_params)
    engine = tiny_engine(tiny_llama_dir, overlap=overlap)
    faults = FaultyRunner(engine.runner, where)  # before the coordinator takes its launch
    async with engine:
        # The poisoned request arrives with the others: their shared batch fails.
        *outputs, bad = await run_all(engine, [*PROMPTS, POISONED], [*params, greedy(12)])
        assert [o.token_ids for o in outputs] == expected
        assert [o.finish_reason for o in outputs] == ["length"] * 3
        assert (bad.finish_reason, bad.error_kind) == ("error", "engine")
        assert "injected" in (bad.error or "")
        assert max(b.size for b in faults.failed) == 4 and faults.failed[-1].size == 1
        await assert_clean(engine)

        # It arrives while they decode: its lone prefill fails (with overlap, the decode
        # launched after it is re-queued too).
        async def late_poison() -> RequestOutput:
            while engine.stats().running < 3:
                await asyncio.sleep(0.002)
            return await engine.generate(POISONED, greedy(5))

        failures = len(faults.failed)
        outputs_and_bad = await asyncio.wait_for(asyncio.gather(
            run_all(engine, PROMPTS, long_params), late_poison()), TIMEOUT)
        assert [o.token_ids for o in outputs_and_bad[0]] == expected_long
        assert outputs_and_bad[1].error_kind == "engine"
        # (With overlap the decode launched after it may hold it too: it is discarded.)
        assert faults.failed[failures].size == 1
        await assert_clean(engine)

        # Nothing a failed batch computed went into the prefix cache: cached hits give the
        # same tokens.
        again = await run_all(engine, PROMPTS, params)
        assert [o.token_ids for o in again] == expected
        assert all(o.cached_tokens > 0 for o in again[:2])
        await assert_clean(engine)


@pytest.mark.parametrize("fail_at", [1, 2, 6])
@pytest.mark.parametrize("where", ["launch", "forward"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
async def test_a_transient_fault_costs_no_request_anything(
        tiny_llama_dir: Path, fail_at: int, where: str, overlap: bool) -> None:
    prompts = [*PROMPTS, [11, 12, 13, 14, 15]]
    params = [greedy(9), seeded(12, 7), greedy(11), seeded(10, -3)]
    expected = await fault_free(tiny_llama_dir, prompts, params)
    engine = tiny_engine(tiny_llama_dir, overlap=overlap)
    faults = FaultyRunner(engine.runner, where, fail_at=fail_at)
    preempted = record_preemptions(engine)
    async with engine:
        outputs = await run_all(engine, prompts, params)
        assert len(faults.failed) == 1 and faults.failed[0].size > 1
        # Past the prefill, what is recomputed includes outputs.
        assert len(preempted) >= 4 and (fail_at == 1) == (max(preempted) == 0)
        assert [o.finish_reason for o in outputs] == ["length"] * 4
        assert [o.token_ids for o in outputs] == expected
        await assert_clean(engine)


@pytest.mark.parametrize(("chunked", "budget", "fail_at"), [(True, 16, 14), (False, 44, 11)],
                         ids=["chunked", "unchunked"])
async def test_a_recompute_longer_than_the_budget_is_chunked(
        tiny_qwen3_dir: Path, chunked: bool, budget: int, fail_at: int) -> None:
    # 40-token prompts; the recompute after a failed decode covers 40 + ~8 tokens: more than
    # one round's budget, so it is chunked, alone, even with chunked prefill off.
    prompts = [[(7 * i + j) % 400 + 3 for j in range(40)] for i in range(3)]
    params = [greedy(20), seeded(20, 1), greedy(16)]
    options = {"max_extend_tokens": budget, "chunked_prefill": chunked}
    async with tiny_engine(tiny_qwen3_dir, **options) as engine:
        expected = [o.token_ids for o in await run_all(engine, prompts, params)]
    engine = tiny_engine(tiny_qwen3_dir, **options)
    faults = FaultyRunner(engine.runner, "forward", fail_at=fail_at)
    async with engine:
        outputs = await run_all(engine, prompts, params)
        [failed] = faults.failed
        assert failed is faults.launched[fail_at - 1]
        assert failed.phase == "decode" and failed.size == 3
        assert [o.finish_reason for o in outputs] == ["length"] * 3
        assert [o.token_ids for o in outputs] == expected
        await assert_clean(engine)
        # Each request recomputes alone everything before the failed decode, in chunks of
        # at most the budget, then decodes on.
        [done] = set(failed.ends)
        chunks = [(start, min(start + budget, done)) for start in range(0, done, budget)]
        recompute = [b for b in faults.launched[fail_at:] if b.phase == "prefill"]
        assert all(b.size == 1 for b in recompute)
        assert [(b.starts[0], b.ends[0]) for b in recompute] == chunks * 3


async def test_refused_requests_are_invalid_not_engine_errors(tiny_llama_dir: Path) -> None:
    async with tiny_engine(tiny_llama_dir) as engine:
        too_long = [5] * 200
        outputs = await run_all(engine, [too_long, too_long, []], [greedy(4)] * 3,
                                stream=[False, True, False])
        for out in outputs:
            assert (out.finish_reason, out.error_kind) == ("error", "invalid")
            assert out.error
        ok = await engine.generate([5, 6, 7], greedy(3))
        assert ok.finish_reason == "length" and ok.error_kind is None


async def test_a_dead_loop_ends_every_request_and_says_so(tiny_llama_dir: Path) -> None:
    engine = tiny_engine(tiny_llama_dir)
    real_add = engine.scheduler.add_request

    def add_request(uid: int, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if MARKER in prompt_ids:
            raise RuntimeError("the scheduler broke")
        real_add(uid, prompt_ids, params)

    engine.scheduler.add_request = add_request
    # Batches wait at a gate, so the three requests are still running when the poisoned
    # one arrives however fast the machine is.
    gate = threading.Event()
    real_launch = engine.runner.launch

    def launch(batch: Batch) -> Callable[[], ForwardOutput]:
        wait = real_launch(batch)
        return lambda: (gate.wait(TIMEOUT), wait())[1]

    engine.runner.launch = launch  # type: ignore[method-assign]
    async with engine:
        assert engine.alive
        running = [asyncio.ensure_future(run_all(engine, [p], [greedy(100)], stream=[s]))
                   for p, s in zip(PROMPTS, [False, True, False])]
        gate.set()
        while engine.stats().running < 3:
            await asyncio.sleep(0.01)
        gate.clear()
        poisoned = asyncio.ensure_future(engine.generate(POISONED, greedy(4)))
        await asyncio.sleep(0.05)   # the Add is queued before any batch passes the gate
        gate.set()
        bad = await asyncio.wait_for(poisoned, TIMEOUT)
        outputs = [(await asyncio.wait_for(task, TIMEOUT))[0] for task in running]
        for out in [bad, *outputs]:
            assert (out.finish_reason, out.error_kind) == ("error", "engine")
        assert not engine.alive
        after = await asyncio.wait_for(engine.generate([5, 6], greedy(2)), TIMEOUT)
        assert (after.finish_reason, after.error_kind) == ("error", "engine")
    assert not engine.alive


async def test_abort_all_ends_every_request_with_abort(tiny_llama_dir: Path) -> None:
    async with tiny_engine(tiny_llama_dir) as engine:
        pending = asyncio.ensure_future(run_all(engine, PROMPTS, [greedy(100)] * 3))
        while engine.stats().running < 3:
            await asyncio.sleep(0.01)
        engine.abort_all()
        outputs = await asyncio.wait_for(pending, TIMEOUT)
        assert [o.finish_reason for o in outputs] == ["abort"] * 3
        assert all(len(o.token_ids) < 100 for o in outputs)
        await assert_clean(engine)
        # The engine serves on.
        out = await engine.generate(PROMPTS[0], greedy(3))
        assert out.finish_reason == "length"


async def test_prefix_cache_counters_and_cached_tokens(tiny_llama_dir: Path) -> None:
    shared = list(range(40, 70))
    async with tiny_engine(tiny_llama_dir) as engine:
        first = await engine.generate([*shared, 9, 9], greedy(3))
        [second, third] = await run_all(engine, [[*shared, 7, 7, 7], [*shared, 8]],
                                        [greedy(3)] * 2, stream=[True, False])
        assert first.cached_tokens == 0
        assert second.cached_tokens == third.cached_tokens == 28  # whole pages of 4
        stats = engine.stats()
        assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (3, 2)
        assert stats.prefix_cache_query_tokens == 32 + 33 + 31
        assert stats.prefix_cache_hit_tokens == 56


async def test_extreme_sampling_values_cannot_fail_a_shared_batch(
        tiny_llama_dir: Path) -> None:
    prompt = PROMPTS[1]
    async with tiny_engine(tiny_llama_dir) as engine:
        alone = await engine.generate(prompt, greedy(8))
        others = [SamplingParams(max_tokens=8, top_k=2**31 - 1, ignore_eos=True),
                  SamplingParams(max_tokens=8, top_k=512 + 5, seed=2**64 - 1,
                                 ignore_eos=True),
                  SamplingParams(max_tokens=8, top_k=5, seed=-(2**63), ignore_eos=True),
                  SamplingParams(max_tokens=8, temperature=1e-40, ignore_eos=True)]
        outputs = await run_all(engine, [prompt] * 5, [greedy(8), *others])
        assert [o.finish_reason for o in outputs] == ["length"] * 5
        assert outputs[0].token_ids == alone.token_ids
        # A temperature below MIN_TEMPERATURE is greedy.
        assert outputs[4].token_ids == alone.token_ids
