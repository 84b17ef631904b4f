"""The priority policy on a real engine: a high-priority request that finds every slot taken
preempts its way in, and the preempted request, recomputed from the prefix cache, ends with
exactly the greedy tokens it produces alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

from asyncinfer.api import LLM, AsyncEngine, EngineStats
from asyncinfer.params import SamplingParams

OPTIONS = {"dtype": "float32", "page_size": 4, "max_running_requests": 2, "num_pages": 256,
           "max_seq_len": 256}
LOW = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27]]
HIGH = [30, 31, 32, 33, 34]


def test_a_high_priority_request_preempts_and_nobody_loses_a_token(
        tiny_llama_dir: Path) -> None:
    alone = LLM(str(tiny_llama_dir), skip_tokenizer_init=True, **OPTIONS)
    greedy = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in alone.generate([*LOW, HIGH], [
        greedy.replace(priority=5), greedy.replace(priority=3),
        greedy.replace(max_tokens=6, priority=0)], use_tqdm=False)]
    alone.close()

    finished: list[str] = []

    async def serve() -> tuple[list[list[int]], EngineStats]:
        async with AsyncEngine(str(tiny_llama_dir), skip_tokenizer_init=True,
                               policy="priority", **OPTIONS) as engine:
            async def run(name: str, prompt: list[int], params: SamplingParams) -> list[int]:
                out = await engine.generate(prompt, params)
                finished.append(name)
                return out.token_ids

            low = [asyncio.ensure_future(run(f"low{i}", p, greedy.replace(priority=5 - 2 * i)))
                   for i, p in enumerate(LOW)]
            while engine.stats().running < 2:  # both slots taken, decoding
                await asyncio.sleep(0.005)
            high = await run("high", HIGH, greedy.replace(max_tokens=6, priority=0))
            tokens = [*(await asyncio.gather(*low)), high]
            await engine.wait_idle()
            return tokens, engine.stats()

    tokens, stats = asyncio.run(serve())
    assert finished[0] == "high", "it did not wait for a slot to free"
    assert tokens == expected
    assert (stats.running, stats.waiting, stats.kv_pages_used) == (0, 0, 0)
