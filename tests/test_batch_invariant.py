"""The batch-invariant mode (``batch_invariant``): a request's tokens and logprobs are bit
for bit the same alone, beside any other requests, with its prompt in chunks and after a
prefix-cache hit, greedy and seeded, bf16 on the CPU. Where the mode cannot hold (no
product kernels of our own on this CPU, float32 compute), it is refused, naming it. Its CUDA
path: tests/test_batch_invariant_triton.py.

The reference of every case is the request alone on an engine without a prefix cache; the
engines under test keep their radix caches warm across cases, so hits of any length occur.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncinfer.api import LLM
from asyncinfer.config import EngineConfig
from asyncinfer.engine.invariant import batch_invariant, check_batch_invariant
from asyncinfer.errors import ConfigError
from asyncinfer.kernels import cpu as native
from asyncinfer.params import SamplingParams

KERNELS = native.load()
HOLDS = KERNELS is not None and KERNELS.fixed_products is not None
needs_kernels = pytest.mark.skipif(
    not HOLDS, reason="the mode needs our AVX-512, AMX or AVX2 product kernels")

# Prompts of token ids sharing prefixes of several lengths, so that one's cached pages are
# another's prefix; one is longer than a 512-row product (where AMX hands products to torch
# when the mode is off) and than two 256-token chunks.
_RNG = random.Random(36)
_BASE = [_RNG.randint(10, 40000) for _ in range(700)]
PROMPTS = [_BASE[:n] + [_RNG.randint(10, 40000) for _ in range(m)]
           for n, m in ((0, 23), (40, 9), (40, 30), (72, 1), (100, 17), (0, 61), (600, 5))]
MAX_TOKENS = 10


def _engine(model: Path, **options: Any) -> LLM:
    return LLM(str(model), skip_tokenizer_init=True, dtype="bfloat16", batch_invariant=True,
               max_running_requests=8, max_seq_len=1024, **options)


@pytest.fixture(scope="module")
def engines(smollm2_dir: Path) -> Iterator[dict[str, LLM]]:
    if not HOLDS:
        pytest.skip("the mode is refused on this CPU")
    made = {"reference": _engine(smollm2_dir, cache_type="naive"),
            "radix": _engine(smollm2_dir),
            "chunked": _engine(smollm2_dir, max_extend_tokens=64)}
    try:
        yield made
    finally:
        for llm in made.values():
            llm.close()


def _params(seed: int | None) -> SamplingParams:
    """Greedy (``seed`` None) or seeded at temperature 1, with the sampled tokens' logprobs."""
    if seed is None:
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                              logprobs=2)
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
                          ignore_eos=True, logprobs=2)


def _answer(output: Any) -> list[tuple[int, float, tuple[tuple[int, float], ...]]]:
    """Each token with its logprob and top alternatives: what must be bit-identical."""
    return [(t, lp.logprob, lp.top) for t, lp in zip(output.token_ids, output.logprobs)]


_REFERENCE: dict[tuple[int, int | None], Any] = {}


def _alone(engines: dict[str, LLM], prompt: int, seed: int | None) -> Any:
    key = (prompt, seed)
    if key not in _REFERENCE:
        [out] = engines["reference"].generate([PROMPTS[prompt]], _params(seed), use_tqdm=False)
        _REFERENCE[key] = _answer(out)
    return _REFERENCE[key]


@needs_kernels
@settings(max_examples=10, deadline=None, derandomize=True)
@given(target=st.integers(0, len(PROMPTS) - 1),
       mates=st.lists(st.integers(0, len(PROMPTS) - 1), max_size=5),
       place=st.integers(0, 5),
       seed=st.one_of(st.none(), st.integers(0, 2**31)),
       engine=st.sampled_from(["radix", "chunked"]))
def test_a_request_answers_the_same_in_any_batch_chunking_and_cache_state(
        engines: dict[str, LLM], target: int, mates: list[int], place: int,
        seed: int | None, engine: str) -> None:
    place = min(place, len(mates))
    prompts = [PROMPTS[m] for m in mates]
    prompts.insert(place, PROMPTS[target])
    # The mates sample otherwise (other seeds, or greedy beside seeded): only the target's
    # own sampling is shared with its reference.
    params = [_params(None if i % 2 else 1000 + i) for i in range(len(prompts))]
    params[place] = _params(seed)
    outputs = engines[engine].generate(prompts, params, use_tqdm=False)
    assert _answer(outputs[place]) == _alone(engines, target, seed)


@needs_kernels
def test_greedy_alone_and_beside_another_agree(engines: dict[str, LLM]) -> None:
    llm = engines["radix"]
    prompt = [_RNG.randint(10, 40000) for _ in range(45)]   # in no other test
    other = [_RNG.randint(10, 40000) for _ in range(130)]
    [alone] = llm.generate([prompt], _params(None), use_tqdm=False)
    beside = llm.generate([prompt, other], _params(None), use_tqdm=False)
    assert alone.cached_tokens == 0
    assert _answer(beside[0]) == _answer(alone)


@needs_kernels
@pytest.mark.parametrize("temperature", [0.0, 0.05, 1.0])
def test_a_prefix_cache_hit_answers_as_the_miss(engines: dict[str, LLM],
                                                temperature: float) -> None:
    llm = engines["radix"]
    prompt = [_RNG.randint(10, 40000) for _ in range(90)]   # in no other test
    params = SamplingParams(max_tokens=24, temperature=temperature, seed=7, ignore_eos=True,
                            logprobs=1)
    [miss] = llm.generate([prompt], params, use_tqdm=False)
    [hit] = llm.generate([prompt], params, use_tqdm=False)
    assert miss.cached_tokens == 0 and hit.cached_tokens == 80   # five whole pages
    assert _answer(hit) == _answer(miss)


@needs_kernels
def test_a_long_prompt_in_chunks_answers_as_in_one(engines: dict[str, LLM]) -> None:
    [whole] = engines["reference"].generate([PROMPTS[-1]], _params(3), use_tqdm=False)
    chunked, _ = engines["chunked"].generate([PROMPTS[-1], PROMPTS[1]], _params(3),
                                             use_tqdm=False)
    assert _answer(chunked) == _answer(whole)


@pytest.mark.skipif(HOLDS, reason="this CPU has our product kernels: the mode runs")
def test_the_mode_is_refused_without_our_product_kernels(smollm2_dir: Path) -> None:
    with pytest.raises(ConfigError, match="batch_invariant needs this CPU's own"):
        _engine(smollm2_dir)


@pytest.mark.parametrize(("device", "dtype", "ours", "ranks", "why"), [
    ("mps", torch.bfloat16, True, 1, "runs on CPUs and CUDA GPUs"),
    ("cpu", torch.bfloat16, False, 1, "own matrix-product kernels"),
    ("cpu", torch.float32, True, 1, "bfloat16 model"),
    ("cpu", torch.bfloat16, True, 4, "one or two tensor-parallel ranks"),
])
def test_where_the_guarantee_would_not_hold_the_mode_is_refused(
        device: str, dtype: torch.dtype, ours: bool, ranks: int, why: str) -> None:
    if ours and device == "cpu" and not HOLDS:
        pytest.skip("this CPU has no product kernels: refused for that first")
    config = EngineConfig(device="cpu", dtype="bfloat16", batch_invariant=True,
                          tensor_parallel_size=ranks)
    with pytest.raises(ConfigError, match=why):
        check_batch_invariant(config, torch.device(device), dtype, KERNELS if ours else None)


@pytest.mark.parametrize(("products", "experts", "on"), [
    ("avx512", 0, True), ("amx", 0, False), (None, 0, False), ("avx512", 8, False)])
def test_by_default_the_mode_is_on_where_it_holds_and_costs_nothing_measured(
        products: str | None, experts: int, on: bool) -> None:
    class Kernels:  # what the decision reads of the compiled kernels
        pass

    kernels = Kernels()
    kernels.products = kernels.fixed_products = products  # type: ignore[attr-defined]
    config = EngineConfig(device="cpu", dtype="bfloat16", cpu_fp32_compute="off")
    assert batch_invariant(config, torch.device("cpu"), torch.bfloat16, kernels,  # type: ignore[arg-type]
                           experts) is on
    off = EngineConfig(device="cpu", dtype="bfloat16", cpu_fp32_compute="off",
                       batch_invariant=False)
    assert batch_invariant(off, torch.device("cpu"), torch.bfloat16, kernels,  # type: ignore[arg-type]
                           experts) is False
    if experts:
        on_asked = EngineConfig(device="cpu", dtype="bfloat16", cpu_fp32_compute="off",
                                batch_invariant=True)
        with pytest.raises(ConfigError, match="mixture-of-experts"):
            batch_invariant(on_asked, torch.device("cpu"), torch.bfloat16, kernels,  # type: ignore[arg-type]
                            experts)


def _avx2_build() -> native.NativeKernels:
    if "avx2" not in native.cpu_flags().split() or "fma" not in native.cpu_flags().split():
        pytest.skip("needs AVX2 and FMA")
    kernels = native.load("x86-64-v3")
    if kernels is None:
        pytest.skip("no C compiler for -march=x86-64-v3")
    return kernels


@pytest.mark.parametrize("bias", [False, True])
def test_the_avx2_product_sums_each_row_alike_whatever_the_rows(bias: bool) -> None:
    """The AVX2 build's product (the mode's on an AVX2 CPU): a row's output is the same bits
    alone and among any number of rows, near torch's bf16 linear, and, where this CPU has
    the AVX-512 kernel, the same bits as it (both sum each pair of k by two FMAs in turn)."""
    kernels = _avx2_build()
    assert kernels.products is None and kernels.fixed_products == "avx2"
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(80, 96, generator=gen) * 0.1).bfloat16()
    b = (torch.randn(80, generator=gen) * 0.1).bfloat16() if bias else None
    packed = kernels.pack(weight)
    x = torch.randn(150, 96, generator=gen).bfloat16()
    whole = kernels.linear(x, packed, 80, b)
    for rows in (1, 3, 4, 5, 17, 97):
        assert torch.equal(kernels.linear(x[:rows], packed, 80, b), whole[:rows]), rows
    assert torch.equal(kernels.linear(x[40:41], packed, 80, b), whole[40:41])
    reference = torch.nn.functional.linear(x.float(), weight.float(),
                                           None if b is None else b.float())
    assert (whole.float() - reference).abs().max() <= 0.02 * reference.abs().max()
    wide = native.load()
    if wide is not None and wide.products == "avx512":
        assert torch.equal(wide.linear(x, wide.pack(weight), 80, b), whole)


def test_on_the_avx2_build_the_mode_holds_too(smollm2_dir: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine on the kernels built for AVX2 (what an AVX2-only CPU gets): its products
    run on the AVX2 kernel, and a long prompt in chunks beside another request, then again
    from the cache, answers as it does alone and whole."""
    import asyncinfer.engine.runner as runner_module

    avx2 = _avx2_build()
    monkeypatch.setattr(runner_module, "load_cpu_kernels", lambda: avx2)
    monkeypatch.setattr(native, "load", lambda march="native": avx2)
    whole = _engine(smollm2_dir, cache_type="naive")
    try:
        products = {m.packed.kernels.fixed_products for m in whole.runner.model.modules()
                    if getattr(m, "packed", None) is not None}
        assert products == {"avx2"}
        [alone] = whole.generate([PROMPTS[-1]], _params(5), use_tqdm=False)
    finally:
        whole.close()
    chunked = _engine(smollm2_dir, max_extend_tokens=64)
    try:
        first, _ = chunked.generate([PROMPTS[-1], PROMPTS[2]], _params(5), use_tqdm=False)
        [again] = chunked.generate([PROMPTS[-1]], _params(5), use_tqdm=False)
    finally:
        chunked.close()
    assert again.cached_tokens > 0
    assert _answer(first) == _answer(alone) == _answer(again)


@needs_kernels
def test_under_float32_compute_the_mode_answers_as_in_bf16(engines: dict[str, LLM],
                                                           smollm2_dir: Path) -> None:
    """Where a CPU computes bf16 in float32 kernels (cpu_fp32_compute, the default on a CPU
    without bf16 units), the mode multiplies through our kernels all the same and the cache
    holds the same values in float32: the answers are the bf16 mode's, chunked or not."""
    fp32 = _engine(smollm2_dir, cpu_fp32_compute="on", max_extend_tokens=64)
    try:
        for prompt in (0, len(PROMPTS) - 1):
            [ours] = fp32.generate([PROMPTS[prompt]], _params(9), use_tqdm=False)
            assert _answer(ours) == _alone(engines, prompt, 9)
    finally:
        fp32.close()


@needs_kernels
def test_two_tensor_parallel_ranks_keep_the_mode(tiny_llama_dir: Path) -> None:
    """Under --tp 2 (gloo between two processes), a prompt in chunks beside other requests,
    then from the cache, answers as it does alone and whole on two ranks."""
    options: dict[str, Any] = {"skip_tokenizer_init": True, "dtype": "bfloat16",
                               "batch_invariant": True, "tensor_parallel_size": 2,
                               "max_running_requests": 4, "max_seq_len": 512,
                               "tp_guard_interval": 1}
    rng = random.Random(2)
    prompt = [rng.randint(2, 500) for _ in range(150)]
    mates = [[rng.randint(2, 500) for _ in range(n)] for n in (20, 70)]
    whole = LLM(str(tiny_llama_dir), cache_type="naive", **options)
    try:
        [alone] = whole.generate([prompt], _params(4), use_tqdm=False)
    finally:
        whole.close()
    chunked = LLM(str(tiny_llama_dir), max_extend_tokens=32, **options)
    try:
        beside = chunked.generate([mates[0], prompt, mates[1]], _params(4), use_tqdm=False)
        [again] = chunked.generate([prompt], _params(4), use_tqdm=False)
    finally:
        chunked.close()
    assert again.cached_tokens > 0
    assert _answer(beside[1]) == _answer(alone) == _answer(again)
