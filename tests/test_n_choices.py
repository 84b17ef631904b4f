"""``n`` > 1: choices sharing one prefill of the prompt, each with its own seed stream, stop
and finish; aborting one request ends every choice; the HTTP surface (``n``, ``best_of``, a
list of prompts) through the openai SDK against a real server."""

from __future__ import annotations

import asyncio
import random
import re
from pathlib import Path
from typing import Any

import pytest

from asyncinfer.api import LLM, AsyncEngine
from asyncinfer.errors import InvalidRequestError
from asyncinfer.params import MAX_N, SamplingParams, choice_seed
from tests.conftest import engine_under_test
from tests.hf_reference import hf_greedy, load_hf
from tests.test_server_process import NAME

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


def test_preempted_choices_end_with_their_own_tokens(tiny_llama_dir: Path) -> None:
    """Two slots: two of the three choices run, and a request of better priority preempts
    one of them; every choice still ends with the tokens its seed samples alone."""
    options = {"dtype": "float32", "page_size": PAGE, "max_running_requests": 2,
               "num_pages": 256, "max_seq_len": 128}
    ids = prompt(21, seed=8)
    params = sampled(3, max_tokens=40, priority=5)
    alone = LLM(str(tiny_llama_dir), skip_tokenizer_init=True, **options)
    expected = [o.token_ids for o in alone.generate(
        [ids] * 3, [params.replace(n=1, seed=choice_seed(11, i)) for i in range(3)],
        use_tqdm=False)]
    alone.close()

    preempted: list[int] = []

    async def run() -> list[list[int]]:
        async with AsyncEngine(str(tiny_llama_dir), skip_tokenizer_init=True,
                               policy="priority", **options) as engine:
            sched = engine.scheduler
            preempt = sched.preempt

            def counted(uid: int, keep_prefix: bool = False) -> bool:
                preempted.append(uid)
                return preempt(uid, keep_prefix)

            sched.preempt = counted  # type: ignore[method-assign]
            task = asyncio.ensure_future(engine.generate(ids, params))
            while engine.stats().running < 2:
                await asyncio.sleep(0.005)
            await engine.generate(prompt(9, seed=1), sampled(1, max_tokens=4))
            out = await task
            await engine.wait_idle()
            sched.check_invariants()
            assert not sched.running and not sched.waiting
            return [o.token_ids for o in out.outputs]

    assert asyncio.run(run()) == expected
    assert preempted, "a choice was preempted"


def test_best_of_returns_the_n_most_likely(tiny_llama_dir: Path) -> None:
    llm = tiny_llm(tiny_llama_dir)
    ids = prompt(18, seed=4)
    out = llm.generate([ids], sampled(2, best_of=5, max_tokens=6), use_tqdm=False)[0]
    singles = llm.generate([ids] * 5, [sampled(1, choice_seed(11, i), max_tokens=6, logprobs=0)
                                       for i in range(5)], use_tqdm=False)
    scores = [sum(t.logprob for t in s.logprobs or []) for s in singles]
    best = sorted(range(5), key=lambda i: -scores[i])[:2]
    assert [o.token_ids for o in out.outputs] == [singles[i].token_ids for i in best]
    assert [o.index for o in out.outputs] == [0, 1]
    for o, i in zip(out.outputs, best):
        assert o.cumulative_logprob == pytest.approx(scores[i], abs=1e-5)
        assert o.logprobs is None  # not asked for: used for the ranking only
    assert out.logprobs is None and out.token_ids == out.outputs[0].token_ids


def test_choices_carry_their_logprobs(tiny_llama_dir: Path) -> None:
    llm = tiny_llm(tiny_llama_dir)
    ids = prompt(14, seed=6)
    out = llm.generate([ids], sampled(3, logprobs=2, max_tokens=5), use_tqdm=False)[0]
    singles = llm.generate([ids] * 3, [sampled(1, choice_seed(11, i), logprobs=2,
                                               max_tokens=5) for i in range(3)],
                           use_tqdm=False)
    for choice, single in zip(out.outputs, singles):
        assert choice.logprobs is not None and single.logprobs is not None
        assert [t.token for t in choice.logprobs] == choice.token_ids
        assert [t.logprob for t in choice.logprobs] == pytest.approx(
            [t.logprob for t in single.logprobs], abs=1e-4)
        assert all(len(t.top) == 2 for t in choice.logprobs)
    assert out.logprobs == out.outputs[0].logprobs


def test_bounds_of_n_and_best_of() -> None:
    with pytest.raises(InvalidRequestError, match="n must be"):
        SamplingParams(n=MAX_N + 1)
    with pytest.raises(InvalidRequestError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    assert SamplingParams(n=3, best_of=3).choices == 3
    assert choice_seed(5, 0) == 5 and choice_seed(None, 2) is None
    assert len({choice_seed(5, i) for i in range(MAX_N)}) == MAX_N


# --- HTTP, through the openai SDK against `asyncinfer serve` ---------------------------------

PROMPT = "The three best things about the sea are"


@pytest.fixture(scope="module")
def server(plain_server: str) -> str:
    return plain_server


@pytest.fixture(scope="module")
def client(server: str) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


def _completion_texts(client: Any, stream: bool, **body: Any) -> list[str]:
    if not stream:
        response = client.completions.create(model=NAME, **body)
        assert [c.index for c in response.choices] == list(range(len(response.choices)))
        return [c.text for c in response.choices]
    texts: dict[int, str] = {}
    finished: list[int] = []
    for chunk in client.completions.create(model=NAME, stream=True, **body):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finished.append(c.index)
    assert sorted(finished) == sorted(texts)
    return [texts[i] for i in sorted(texts)]


def _chat_texts(client: Any, stream: bool, **body: Any) -> list[str]:
    if not stream:
        response = client.chat.completions.create(model=NAME, **body)
        assert [c.index for c in response.choices] == list(range(len(response.choices)))
        return [c.message.content or "" for c in response.choices]
    texts: dict[int, str] = {}
    roles: dict[int, str | None] = {}
    for chunk in client.chat.completions.create(model=NAME, stream=True, **body):
        for c in chunk.choices:
            roles.setdefault(c.index, c.delta.role)
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert set(roles.values()) == {"assistant"}, "each choice's first chunk names the role"
    return [texts[i] for i in sorted(texts)]


SEEDED = {"n": 3, "seed": 7, "temperature": 1.0, "max_tokens": 10}


def test_http_seeded_choices_reproducible_and_distinct(client: Any) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    for texts_of, body in ((_completion_texts, {"prompt": PROMPT}),
                           (_chat_texts, {"messages": messages})):
        whole = texts_of(client, False, **body, **SEEDED)
        assert len(whole) == 3 and len(set(whole)) == 3
        assert texts_of(client, False, **body, **SEEDED) == whole
        assert texts_of(client, True, **body, **SEEDED) == whole


def test_http_best_of(client: Any) -> None:
    response = client.completions.create(model=NAME, prompt=PROMPT, n=2, best_of=4, seed=5,
                                         temperature=1.0, max_tokens=6)
    assert [c.index for c in response.choices] == [0, 1]
    every = client.completions.create(model=NAME, prompt=PROMPT, n=4, seed=5,
                                      temperature=1.0, max_tokens=6)
    assert {c.text for c in response.choices} <= {c.text for c in every.choices}


def test_http_list_of_prompts_times_n(client: Any) -> None:
    prompts = [PROMPT, "Once upon a time", "def add(a, b):", "Paris is"]
    body = {"n": 2, "seed": 3, "temperature": 1.0, "max_tokens": 6}
    response = client.completions.create(model=NAME, prompt=prompts, **body)
    assert [c.index for c in response.choices] == list(range(8))
    singles = [client.completions.create(model=NAME, prompt=p, **body) for p in prompts]
    assert [c.text for c in response.choices] == [c.text for s in singles for c in s.choices]
    assert response.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert response.usage.completion_tokens == sum(s.usage.completion_tokens
                                                   for s in singles)
    assert _completion_texts(client, True, prompt=prompts, **body) == [
        c.text for c in response.choices]
    chunks = list(client.completions.create(model=NAME, prompt=prompts, stream=True,
                                            stream_options={"include_usage": True}, **body))
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens == response.usage.prompt_tokens
    assert usage[0].completion_tokens == response.usage.completion_tokens
    ids = [[1, 2, 3, 4], [5, 6, 7]]
    by_ids = client.completions.create(model=NAME, prompt=ids, **body)
    assert [c.index for c in by_ids.choices] == [0, 1, 2, 3]
    assert by_ids.usage.prompt_tokens == 7


def test_http_usage_counts_the_prompt_once_and_it_is_prefilled_once(
        client: Any, server: str) -> None:
    import urllib.request

    if engine_under_test()[1]["cache_type"] != "radix":
        pytest.skip("the choices share the prompt through the radix cache")

    def hit_tokens() -> float:
        with urllib.request.urlopen(f"{server}/metrics") as response:
            text = response.read().decode()
        found = re.search(r"^asyncinfer_prefix_cache_hit_tokens(?:_total)? (\S+)$", text,
                          re.MULTILINE)
        assert found is not None
        return float(found.group(1))

    prompt = " ".join(f"w{i}" for i in range(40))   # in no earlier request
    before = hit_tokens()
    response = client.completions.create(model=NAME, prompt=prompt, n=4, max_tokens=4,
                                         seed=1, temperature=1.0,
                                         extra_body={"ignore_eos": True})
    gained = hit_tokens() - before
    tokens = response.usage.prompt_tokens
    assert tokens > 40 and response.usage.completion_tokens == 4 * 4
    assert response.usage.prompt_tokens_details.cached_tokens == 0  # choice 0 found none
    # Choices 1-3 each found choice 0's full prompt pages (of 16 tokens): one prefill.
    assert gained == 3 * ((tokens - 1) // 16) * 16


@pytest.mark.parametrize("body, param", [
    ({"n": MAX_N + 1}, "n"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"n": 2, "prompt": ["a"] * 65}, "prompt"),
    ({"n": 1, "best_of": 3, "stream": True}, "best_of"),
])
def test_http_refusals_name_the_field(server: str, body: dict[str, Any], param: str) -> None:
    import json
    import urllib.error
    import urllib.request

    data = json.dumps({"prompt": PROMPT, "max_tokens": 2, **body}).encode()
    request = urllib.request.Request(f"{server}/v1/completions", data,
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request)
    assert refused.value.code == 400
    assert json.loads(refused.value.read())["error"]["param"] == param
