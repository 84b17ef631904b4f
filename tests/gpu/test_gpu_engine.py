"""The CUDA path on a GPU: flashinfer attention against the torch backend (bf16; FP8 caches on
the task the trained models solve), CUDA-graph decode and prefill against eager, overlap on
against off, seeded sampling on the GPU, float32 through the torch backend against
transformers, and no page or row left behind."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncinfer.api import LLM
from asyncinfer.attention.flashinfer_backend import FlashInferBackend
from asyncinfer.attention.torch_backend import TorchBackend
from asyncinfer.errors import ConfigError
from asyncinfer.params import SamplingParams
from tests.gpu.conftest import VOCAB, alternating, needs_gpu
from tests.hf_reference import hf_greedy, load_hf
from tests.test_flashinfer_runner import RUNNER_PROMPT_LENS, graph_and_eager

pytestmark = [pytest.mark.gpu, needs_gpu]

TOKENS = 32
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)


def varied_prompts(n: int = 24, seed: int = 0) -> list[list[int]]:
    """Lengths from 1 to 700, some sharing long prefixes (radix hits, extends over them)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 2000) for _ in range(300)]
    lengths = ([1, 2, 15, 16, 17, 63, 130, 257, 511, 700] + [
        rng.randrange(1, 400) for _ in range(n)])[:n]
    prompts = [[rng.randrange(3, 2000) for _ in range(k)] for k in lengths]
    for i in range(0, n, 4):
        prompts[i] = shared[: rng.randrange(20, 300)] + prompts[i]
    return prompts


def generate(model_dir: Path, prompts: list[list[int]], params: object = GREEDY,
             **options: object) -> tuple[list[list[int]], LLM]:
    defaults: dict[str, object] = {"device": "cuda", "dtype": "bfloat16",
                                   "max_running_requests": 32, "max_seq_len": 1200,
                                   "kv_cache_gb": 1.0}
    llm = LLM(str(model_dir), skip_tokenizer_init=True, **{**defaults, **options})
    outputs = llm.generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.token_ids for o in outputs], llm


def assert_nothing_held(llm: LLM) -> None:
    sched = llm.scheduler
    sched.check_invariants()
    assert not sched.running and not sched.waiting
    assert sched.kv.allocator.num_free + sched.kv.cached_pages == llm.runner.num_pages
    assert len(sched.free_rows) == llm.runner.max_rows


def alternation_prompts(n: int = 24, seed: int = 0) -> list[list[int]]:
    """``a b a b ...`` prompts of 2 to 700 tokens; every fourth continues the first one's
    pair, so it shares a prefix with it (radix hits, extends over cached pages)."""
    rng = random.Random(seed)
    lengths = ([2, 3, 15, 16, 17, 63, 130, 257, 511, 700] + [
        rng.randrange(2, 400) for _ in range(n)])[:n]
    first = (rng.randrange(3, VOCAB), rng.randrange(3, VOCAB))
    pairs = [first if i % 4 == 0 else (rng.randrange(3, VOCAB), rng.randrange(3, VOCAB))
             for i in range(n)]
    return [alternating(pair, k) for pair, k in zip(pairs, lengths)]


@pytest.mark.parametrize("model", ["trained_qwen3_dir", "trained_llama_dir"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_equals_torch_backend_bf16(model: str, page_size: int,
                                              request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(model)
    prompts = alternation_prompts()
    ours, llm = generate(model_dir, prompts, page_size=page_size,
                         attention_backend="flashinfer")
    assert isinstance(llm.runner.backend, FlashInferBackend) and llm.runner.graphs is not None
    assert_nothing_held(llm)
    llm.close()
    reference, _ = generate(model_dir, prompts, page_size=page_size,
                            attention_backend="torch")
    mismatched = [i for i, (a, b) in enumerate(zip(ours, reference)) if a != b]
    assert not mismatched, [(len(prompts[i]), ours[i], reference[i]) for i in mismatched]
    # The model really solves the task: the prompts' alternation goes on.
    assert ours == [alternating((p[len(p) % 2], p[(len(p) + 1) % 2]), TOKENS)
                    for p in prompts]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_cache_still_solves_the_task_on_both_backends(
        trained_qwen3_dir: Path, kv_cache_dtype: str) -> None:
    """flashinfer's FP8-KV decode and prefill kernels (graphs on) and the torch backend's
    reading of FP8 pages: both go on with every prompt's alternation."""
    prompts = alternation_prompts(seed=2)
    want = [alternating((p[len(p) % 2], p[(len(p) + 1) % 2]), TOKENS) for p in prompts]
    fi, llm = generate(trained_qwen3_dir, prompts, page_size=16, attention_backend="flashinfer",
                       cuda_graph=True, kv_cache_dtype=kv_cache_dtype)
    assert llm.runner.pool.k.dtype == llm.runner.kv_dtype != torch.bfloat16
    assert llm.runner.pool.k.element_size() == 1
    backend = llm.runner.backend
    assert isinstance(backend, FlashInferBackend)
    assert backend.xqa == (kv_cache_dtype == "fp8_e4m3")  # XQA on Hopper for e4m3
    assert sum(g.replays for g in llm.runner.graphs.decode) > 0  # type: ignore[union-attr]
    assert_nothing_held(llm)
    llm.close()
    ref, torch_llm = generate(trained_qwen3_dir, prompts, page_size=16,
                              attention_backend="torch", kv_cache_dtype=kv_cache_dtype)
    torch_llm.close()
    assert fi == want and ref == want


def test_cuda_graph_decode_equals_eager(trained_qwen3_dir: Path) -> None:
    """Decode batches of 24 replay the graph of 32 (prefill eager on both sides). Trained
    weights: graph-mode plans split the KV their own way, whose bf16 rounding random weights'
    near-ties would not survive."""
    prompts = alternation_prompts(seed=1)
    graphs, llm = generate(trained_qwen3_dir, prompts, cuda_graph=True, cuda_graph_max_bs=32,
                           cuda_graph_max_prefill_tokens=0)
    assert llm.runner.graphs is not None and llm.runner.graphs.prefill == []
    assert all(g.cuda_graph is not None for g in llm.runner.graphs.decode)  # captured
    assert sum(g.replays for g in llm.runner.graphs.decode) >= TOKENS - 1
    eager, _ = generate(trained_qwen3_dir, prompts, cuda_graph=False)
    assert graphs == eager


@pytest.mark.parametrize(("model", "page_size"), [("trained_qwen3_dir", 1),
                                                  ("trained_llama_dir", 16)])
def test_cuda_graph_prefill_equals_eager(model: str, page_size: int,
                                         request: pytest.FixtureRequest) -> None:
    """Prompts of 2 to 700 tokens in rounds of 256 (chunked), some sharing prefixes and all
    run twice (radix hits, extends over cached pages), overlap on: every prefill round
    replays a graph (64 to 256 tokens), with the same greedy tokens as eager prefill."""
    model_dir = request.getfixturevalue(model)
    prompts = alternation_prompts(seed=5)
    options: dict[str, object] = {"page_size": page_size, "max_extend_tokens": 256,
                                  "cuda_graph_max_bs": 16, "overlap": True}
    eager, llm = generate(model_dir, prompts, cuda_graph_max_prefill_tokens=0, **options)
    assert llm.runner.graphs is not None and llm.runner.graphs.prefill == []
    llm.close()
    graphed, llm = generate(model_dir, prompts, **options)
    graphs = llm.runner.graphs
    assert graphs is not None and graphs.prefill_sizes == [64, 128, 192, 256]
    assert all(g.cuda_graph is not None for g in graphs.prefill)
    again = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert sum(g.replays for g in graphs.prefill) > len(prompts) // 2
    assert_nothing_held(llm)
    mismatched = [i for i, (a, b) in enumerate(zip(graphed, eager)) if a != b]
    assert not mismatched, [(len(prompts[i]), graphed[i], eager[i]) for i in mismatched]
    assert again == eager
    # The model solves the task, so the comparison above is between confident tokens. A
    # three-layer model trained for 400 steps can miss a rare token pair (seen: one prompt of
    # 24 repeating its last token, in eager and graphs alike); what is tested is graph ==
    # eager, so one such prompt is allowed.
    solved = [eager[i] == alternating((p[len(p) % 2], p[(len(p) + 1) % 2]), TOKENS)
              for i, p in enumerate(prompts)]
    assert sum(solved) >= len(prompts) - 1, solved


def test_prefill_graph_runner_batches_equal_eager(trained_llama_dir: Path) -> None:
    """Straight to the runner: prompts, chunks over cached prefixes, decoding requests mixed
    with prompts, an exact fit and a batch past the largest graph; same tokens as eager and
    logits within bf16's reach of them."""
    rng = random.Random(6)
    prompts = [alternating((rng.randrange(3, VOCAB), rng.randrange(3, VOCAB)), n)
               for n in RUNNER_PROMPT_LENS]
    options: dict[str, object] = {"device": "cuda", "dtype": "bfloat16", "max_seq_len": 1200,
                                  "kv_cache_gb": 1.0, "max_extend_tokens": 200,
                                  "max_running_requests": 8}
    graphed_llm = LLM(str(trained_llama_dir), skip_tokenizer_init=True, **options)
    eager_llm = LLM(str(trained_llama_dir), skip_tokenizer_init=True, cuda_graph=False,
                    **options)
    graphed = graphed_llm.runner
    assert graphed.graphs is not None and graphed.graphs.prefill_sizes == [64, 128, 192, 200]
    for ours, our_logits, theirs, their_logits in graph_and_eager(graphed, eager_llm.runner,
                                                                  prompts):
        assert torch.equal(ours, theirs)
        torch.testing.assert_close(our_logits, their_logits, atol=0.5, rtol=0.05)
    assert sum(g.replays for g in graphed.graphs.prefill) == 5


def test_overlap_on_equals_overlap_off(qwen3_h128_dir: Path) -> None:
    prompts = varied_prompts(seed=2)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in random.Random(2).choices(range(1, 60), k=len(prompts))]
    on, llm = generate(qwen3_h128_dir, prompts, params, overlap=True)
    assert_nothing_held(llm)
    off, llm = generate(qwen3_h128_dir, prompts, params, overlap=False)
    assert_nothing_held(llm)
    assert on == off


def test_seeded_sampling_on_gpu_does_not_depend_on_the_batch(qwen3_h128_dir: Path) -> None:
    seeded = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=1234,
                            ignore_eos=True)
    other = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)
    prompts = varied_prompts(8, seed=3)
    alone, _ = generate(qwen3_h128_dir, prompts[:1], seeded)
    mixed, _ = generate(qwen3_h128_dir, prompts, [seeded] + [other] * 7)
    assert mixed[0] == alone[0]
    assert len(set(map(tuple, mixed))) > 1  # the others really sampled


def test_float32_torch_backend_on_cuda_is_token_exact(qwen3_h128_dir: Path) -> None:
    """flashinfer has no float32 kernels (its dtype maps hold fp16, bf16 and fp8 only), so
    float32 runs through the torch backend on the GPU: exact against transformers there."""
    with pytest.raises(ConfigError, match="float32"):
        LLM(str(qwen3_h128_dir), skip_tokenizer_init=True, device="cuda", dtype="float32",
            attention_backend="flashinfer", kv_cache_gb=0.5)
    prompts = varied_prompts(8, seed=4)
    ours, llm = generate(qwen3_h128_dir, prompts, dtype="float32")
    assert isinstance(llm.runner.backend, TorchBackend) and llm.runner.graphs is None
    hf = load_hf(qwen3_h128_dir).to("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    assert ours == [hf_greedy(hf, p, TOKENS) for p in prompts]


def test_kv_pool_sized_from_free_memory(qwen3_h128_dir: Path) -> None:
    llm = LLM(str(qwen3_h128_dir), skip_tokenizer_init=True, device="cuda",
              gpu_memory_utilization=0.5, max_seq_len=1024, cuda_graph=False)
    _, total = torch.cuda.mem_get_info()
    pool_bytes = llm.runner.pool.k.nbytes + llm.runner.pool.v.nbytes
    assert 0.25 * total < pool_bytes < 0.5 * total, (pool_bytes, total)
    assert llm.runner.num_pages * llm.runner.page_size > 1_000_000


@pytest.mark.parametrize("norm", [True, False], ids=["qwen3", "llama"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [(16, 8, 128), (12, 3, 64)], ids=["16-8", "12-3"])
@pytest.mark.parametrize("tokens", [3, 40, 300])  # each of rope_group's head groupings
def test_triton_qk_norm_rope_store_matches_the_torch_function(
        norm: bool, dtype: torch.dtype, heads: tuple[int, int, int], tokens: int) -> None:
    from asyncinfer.layers import fused, triton_ops

    assert triton_ops.available(torch.device("cuda"))
    assert len({triton_ops.rope_group(n) for n in (3, 40, 300)}) == 3
    gen = torch.Generator("cuda").manual_seed(0)
    heads, kv_heads, dim = heads
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device="cuda", generator=gen)
    weights = [1 + 0.1 * torch.randn(dim, device="cuda", generator=gen) for _ in range(2)]
    positions = torch.randint(0, 4000, (tokens, 1), device="cuda", generator=gen)
    inv_freq = 1e6 ** -(torch.arange(0, dim, 2, device="cuda") / dim)
    angles = torch.cat([positions * inv_freq] * 2, dim=-1)
    cos, sin = angles.cos().to(dtype).unsqueeze(1), angles.sin().to(dtype).unsqueeze(1)
    slots = torch.randperm(2 * tokens, device="cuda", generator=gen)[:tokens]

    def run(impl: Any, dt: torch.dtype) -> list[torch.Tensor]:
        caches = [torch.zeros(2 * tokens, kv_heads, dim, dtype=dt, device="cuda")
                  for _ in range(2)]
        q_w, k_w = (w.to(dtype).to(dt) for w in weights) if norm else (None, None)
        out = impl(qkv.to(dtype).to(dt), cos.to(dt), sin.to(dt), q_w, k_w, 1e-6, heads,
                   kv_heads, dim, *caches, slots)
        return [t.float() for t in (*out, *caches)]

    names = ("q", "k", "v", "k_cache", "v_cache")
    got = run(triton_ops.qk_norm_rope_store, dtype)
    if dtype == torch.float32:
        for a, b, name in zip(got, run(fused.qk_norm_rope_store, dtype), names, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
        return
    # bf16: from the same bf16 inputs, about as close to the float32 result as the torch
    # function it replaces (which rounds after every op; this rounds twice), and within a
    # few units in the last place of it.
    exact = run(fused.qk_norm_rope_store, torch.float32)
    eager = run(fused.qk_norm_rope_store, dtype)
    for ours, ref, truth, name in zip(got, eager, exact, names, strict=True):
        assert (ours - truth).abs().max() <= 1.5 * (ref - truth).abs().max() + 1e-6, name
        torch.testing.assert_close(ours, truth, atol=2**-6, rtol=2**-5, msg=name)


@pytest.mark.parametrize("rows", [1, 7, 256])
def test_triton_race_picks_the_torch_functions_tokens(rows: int) -> None:
    """The two-kernel sampling pass gives the tokens of engine.sampler.race (its noise is the
    same hash; only log's rounding may differ, which moves no argmax here), greedy rows
    included, over Qwen3's vocabulary in bf16 logits."""
    from asyncinfer.engine.sampler import race
    from asyncinfer.layers import triton_ops

    assert triton_ops.available(torch.device("cuda"), "race")
    gen = torch.Generator("cuda").manual_seed(rows)
    logits = (4 * torch.randn(rows, 151936, device="cuda", generator=gen)).to(torch.bfloat16)
    inv_temperature = torch.tensor([(0.0, 1 / 0.6, 1.0, 2.5)[i % 4] for i in range(rows)],
                                   device="cuda")
    keys = torch.randint(-2**63, 2**63 - 1, (rows,), device="cuda", generator=gen)
    got = triton_ops.race(logits, inv_temperature, keys)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert got.tolist() == race(logits, inv_temperature, keys).tolist()
    # and it samples: the same rows under other keys pick other tokens
    other = triton_ops.race(logits, inv_temperature, keys + 1)
    sampled = (inv_temperature != 0).cpu()
    if sampled.any():
        assert (other.cpu() != got.cpu())[sampled].any()


def test_the_devices_busy_seconds_are_counted(qwen3_h128_dir: Path) -> None:
    """Each batch's span on the engine stream adds to ``device_busy_seconds``: more than
    nothing, and no more than the wall time the rounds took."""
    import time

    start = time.perf_counter()
    _, llm = generate(qwen3_h128_dir, [[5, 6, 7, 8] * 16] * 8)
    wall = time.perf_counter() - start
    stats = llm.engine.stats()
    assert 0 < stats.device_busy_seconds < min(wall, stats.round_host_seconds
                                               + stats.round_wait_seconds)
