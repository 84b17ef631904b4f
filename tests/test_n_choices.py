"""``n`` > 1: choices sharing one prefill of the prompt, each with its own seed stream, stop
and finish; aborting one request ends every choice; the HTTP surface (``n``, ``best_of``, a
list of prompts) through the openai SDK against a real server."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from asyncinfer.api import LLM, AsyncEngine
from asyncinfer.errors import InvalidRequestError
from asyncinfer.params import MAX_N, SamplingParams, choice_seed
from tests.hf_reference import hf_greedy, load_hf

PAGE = 4


def tiny_llm(model_dir: Path, **options: object) -> LLM:
    defaults: dict[str, object] = {
        "dtype": "float32", "page_size": PAGE, "max_running_requests": 4, "num_pages": 80,
        "max_seq_len": 128}
    return LLM(str(model_dir), skip_tokenizer_init=True, **{**defaults, **options})


def prompt(length: int, seed: int = 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def sampled(n: int, seed: int | None = 11, **fields: object) -> SamplingParams:
    options: dict[str, object] = {"max_tokens": 12, "temperature": 1.0, "ignore_eos": True,
                                  **fields}
    return SamplingParams(seed=seed, n=n, **options)  # type: ignore[arg-type]


def test_seeded_choices_are_reproducible_distinct_and_each_its_seed(
        tiny_llama_dir: Path) -> None:
    llm = tiny_llm(tiny_llama_dir)
    ids = prompt(23)
    first, again = (llm.generate([ids], sampled(3), use_tqdm=False)[0] for _ in range(2))
    choices = [o.token_ids for o in first.outputs]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert choices == [o.token_ids for o in again.outputs]
    assert len({tuple(c) for c in choices}) == 3
    assert first.token_ids == choices[0] and first.finish_reason == "length"
    singles = llm.generate([ids] * 3, [sampled(1, choice_seed(11, i)) for i in range(3)],
                           use_tqdm=False)
    assert [s.token_ids for s in singles] == choices


@pytest.mark.parametrize("cache_type", ["radix", "naive"])
def test_greedy_choices_equal_transformers(tiny_llama_dir: Path, cache_type: str) -> None:
    llm = tiny_llm(tiny_llama_dir, cache_type=cache_type)
    ids = prompt(30, seed=5)
    out = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                             n=2), use_tqdm=False)[0]
    expected = hf_greedy(load_hf(tiny_llama_dir), ids, 8)
    assert [o.token_ids for o in out.outputs] == [expected, expected]


@pytest.mark.parametrize("max_tokens", [1, 6])  # choice 0 finished, or running, when shared
def test_prompt_is_prefilled_once(tiny_llama_dir: Path, max_tokens: int) -> None:
    llm = tiny_llm(tiny_llama_dir)
    ids = prompt(30, seed=9)   # 7 full pages of 4 and 2 tokens
    before = llm.engine.stats()
    computed = llm.scheduler.tokens_computed
    out = llm.generate([ids], sampled(4, max_tokens=max_tokens), use_tqdm=False)[0]
    after = llm.engine.stats()
    shared = (len(ids) // PAGE) * PAGE
    assert len(out.outputs) == 4 and out.cached_tokens == 0
    # Choices 1-3 find the 28 tokens of choice 0's full pages and compute the 2 left.
    assert after.prefix_cache_queries - before.prefix_cache_queries == 4
    assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == 3 * shared
    decoded = 4 * (max_tokens - 1)
    assert llm.scheduler.tokens_computed - computed == (
        len(ids) + 3 * (len(ids) - shared) + decoded)
    llm.scheduler.check_invariants()


def test_each_choice_has_its_own_stop_and_finish(tiny_llama_dir: Path) -> None:
    llm = tiny_llm(tiny_llama_dir)
    ids = prompt(17, seed=2)
    free = llm.generate([ids], sampled(4), use_tqdm=False)[0]
    # Stop at the token choice 2 samples fourth: that choice ends there, on "stop".
    stop_at = free.outputs[2].token_ids[3]
    llm.engine.scheduler.eos_token_ids = frozenset([stop_at])
    out = llm.generate([ids], sampled(4, ignore_eos=False), use_tqdm=False)[0]
    for free_choice, choice in zip(free.outputs, out.outputs):
        cut = next((i for i, t in enumerate(free_choice.token_ids) if t == stop_at), None)
        if cut is None:
            assert choice.token_ids == free_choice.token_ids
            assert choice.finish_reason == "length"
        else:
            assert choice.token_ids == free_choice.token_ids[: cut + 1]
            assert choice.finish_reason == "stop"
    assert out.outputs[2].finish_reason == "stop"


def test_streamed_choices_carry_their_index(tiny_llama_dir: Path) -> None:
    async def run() -> tuple[dict[int, list[int]], list[int | None], object]:
        async with AsyncEngine(str(tiny_llama_dir), skip_tokenizer_init=True, dtype="float32",
                               page_size=PAGE, num_pages=80, max_seq_len=128) as engine:
            tokens: dict[int, list[int]] = {}
            ends: list[int | None] = []
            last = None
            async for delta in engine.stream(prompt(19), sampled(3)):
                tokens.setdefault(delta.index, []).extend(delta.token_ids)
                if delta.finish_reason is not None:
                    ends.append(delta.index)
                last = delta.output
            whole = await engine.generate(prompt(19), sampled(3))
            return tokens, ends, (last, whole)

    tokens, ends, (last, whole) = asyncio.run(run())
    assert sorted(ends) == [0, 1, 2]
    assert last is not None and [o.token_ids for o in last.outputs] == [  # type: ignore[attr-defined]
        tokens[0], tokens[1], tokens[2]]
    assert [o.token_ids for o in whole.outputs] == [tokens[0], tokens[1], tokens[2]]  # type: ignore[attr-defined]


def test_abort_of_an_n_request_frees_every_choice(tiny_llama_dir: Path) -> None:
    async def run() -> None:  # room for every choice at once: 7 x 31 pages
        async with AsyncEngine(str(tiny_llama_dir), skip_tokenizer_init=True, dtype="float32",
                               page_size=PAGE, num_pages=220, max_seq_len=128) as engine:
            stream = engine.stream(prompt(21), sampled(4, max_tokens=100))
            seen: set[int] = set()
            async for delta in stream:
                seen.add(delta.index)
                if len(seen) == 4:
                    break
            await stream.aclose()  # type: ignore[attr-defined]
            task = asyncio.ensure_future(engine.generate(prompt(22), sampled(3, max_tokens=100)))
            while engine.stats().running < 3:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await engine.wait_idle()
            sched = engine.scheduler
            assert not sched.waiting and not sched.running and not sched.has_work
            assert sched.kv.allocator.num_free + sched.kv.cached_pages == sched.runner.num_pages
            assert sched.kv.prefix.evictable_pages == sched.kv.cached_pages  # nothing pinned
            sched.check_invariants()

    asyncio.run(run())


def test_choices_queue_under_memory_pressure(tiny_llama_dir: Path) -> None:
    # Room for about two sequences at once: the choices queue, are preempted, and all end.
    llm = tiny_llm(tiny_llama_dir, num_pages=24, max_running_requests=2)
    ids = [prompt(20, seed=s) for s in range(3)]
    outs = llm.generate(ids, sampled(3, max_tokens=20), use_tqdm=False)
    singles = llm.generate([p for p in ids for _ in range(3)],
                           [sampled(1, choice_seed(11, i), max_tokens=20)
                            for _ in ids for i in range(3)], use_tqdm=False)
    assert [o.token_ids for out in outs for o in out.outputs] == [s.token_ids for s in singles]
    llm.scheduler.check_invariants()


def test_bounds_of_n_and_best_of() -> None:
    with pytest.raises(InvalidRequestError, match="n must be"):
        SamplingParams(n=MAX_N + 1)
    with pytest.raises(InvalidRequestError, match="best_of must be at least n"):
        SamplingParams(n=3, best_of=2)
    assert SamplingParams(n=3, best_of=3).choices == 3
    assert choice_seed(5, 0) == 5 and choice_seed(None, 2) is None
    assert len({choice_seed(5, i) for i in range(MAX_N)}) == MAX_N
