"""Qwen3-MoE and Mixtral are token-exact with transformers; the CPU experts run each expert
once over its tokens; the Triton fused MoE equals the torch reference; what is not
implemented is refused."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncinfer.api import LLM
from asyncinfer.core import Batch
from asyncinfer.errors import ConfigError, UnsupportedModelError
from asyncinfer.layers import fused_moe
from asyncinfer.layers.fused import silu_mul
from asyncinfer.layers.linear import can_pack
from asyncinfer.params import SamplingParams
from tests.conftest import _save_tiny
from tests.hf_reference import hf_last_logits, load_hf, place_rows
from tests.test_model_families import _edited
from tests.test_model_outputs import GREEDY, generate_ids, reference
from tests.test_weights_and_dtypes import runner_for
from tests.triton_interpreter import run_interpreted

EXPERTS, TOP_K = 8, 2


def _tiny_qwen3_moe(path: Path, **options: Any) -> Path:
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=1024,
        tie_word_embeddings=False, eos_token_id=1, bos_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **options)
    return _save_tiny(config, path)


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 layers: experts on 0, 2, 3, a dense MLP on 1 (``mlp_only_layers``); top-2 of 8
    renormalised."""
    return _tiny_qwen3_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"), norm_topk_prob=True,
                           mlp_only_layers=[1])


@pytest.fixture(scope="module")
def qwen3_moe_step_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 layers, ``decoder_sparse_step=2``: experts on 1 and 3, top-2 not renormalised."""
    return _tiny_qwen3_moe(tmp_path_factory.mktemp("tiny-qwen3-moe-step"),
                           norm_topk_prob=False, decoder_sparse_step=2)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 layers of top-2 of 8 experts, GQA."""
    from transformers import MixtralConfig

    config = MixtralConfig(
        vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, max_position_embeddings=1024, tie_word_embeddings=False,
        eos_token_id=1, bos_token_id=0, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    return _save_tiny(config, tmp_path_factory.mktemp("tiny-mixtral"))


MODELS = ["qwen3_moe_dir", "qwen3_moe_step_dir", "mixtral_dir"]


@pytest.mark.parametrize("options", [
    {"page_size": 16},
    {"page_size": 4, "max_extend_tokens": 6},   # chunked prefill over radix prefix hits
    {"page_size": 16, "cpu_kernels": False},
], ids=["batched", "chunked", "torch-ops"])
@pytest.mark.parametrize("model", MODELS)
def test_moe_greedy_matches_transformers(model: str, options: dict[str, Any],
                                         request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(model)
    prompts, expected = reference(model_dir)
    assert generate_ids(model_dir, prompts, **options) == expected


@pytest.mark.parametrize("model", ["qwen3_moe_step_dir", "mixtral_dir"])
def test_moe_with_compiled_layer_ops_matches_transformers(
        model: str, request: pytest.FixtureRequest) -> None:
    """The layer ops compiled as on CUDA (warmed up at the first layer's width, dense or
    experts'): transformers' tokens."""
    from tests.test_fused import _llm

    torch._dynamo.reset()  # earlier tests' compiles of the shared ops count towards its limit
    model_dir = request.getfixturevalue(model)
    prompts, expected = reference(model_dir)
    llm = _llm(model_dir, compile_ops=True)
    assert llm.runner.model.ops.compiled
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
async def test_moe_through_the_async_engine_matches_transformers(
        qwen3_moe_dir: Path, overlap: bool) -> None:
    """Concurrent requests through AsyncEngine, with and without overlap."""
    import asyncio

    from asyncinfer.api import AsyncEngine

    prompts, expected = reference(qwen3_moe_dir)
    async with AsyncEngine(str(qwen3_moe_dir), skip_tokenizer_init=True, dtype="float32",
                           max_seq_len=256, max_extend_tokens=32, overlap=overlap) as engine:
        outputs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    assert [o.token_ids for o in outputs] == expected


@pytest.mark.parametrize("model", ["qwen3_moe_dir", "mixtral_dir"])
def test_moe_at_two_ranks_matches_transformers(model: str,
                                               request: pytest.FixtureRequest) -> None:
    """Each expert's width split over 2 CPU ranks (gloo), chunked prefill in the mix."""
    model_dir = request.getfixturevalue(model)
    prompts, expected = reference(model_dir)
    assert generate_ids(model_dir, prompts, tensor_parallel_size=2, page_size=4,
                        max_extend_tokens=24) == expected


@pytest.mark.parametrize("fp32_kernels", ["on", "off"])
@pytest.mark.parametrize("model", MODELS)
def test_moe_bf16_logits_are_close_to_transformers(model: str, fp32_kernels: str,
                                                   request: pytest.FixtureRequest) -> None:
    """bf16 against float32 transformers: the same top token, and every logit within 15% of
    the largest (looser than a dense model's 5%: bf16 rounding flips the router's choice
    for a token near a tie between two experts, and that token's output with it)."""
    model_dir = request.getfixturevalue(model)
    runner = runner_for(model_dir, dtype="bfloat16", cpu_fp32_compute=fp32_kernels)
    assert runner.config.fp32_kernels == (fp32_kernels == "on")
    experts = next(m for m in runner.model.modules() if isinstance(m, fused_moe.Experts))
    # float32 kernels read a shadow; else the experts are packed where this CPU packs bf16.
    assert (experts.shadow is not None) == (fp32_kernels == "on")
    assert (experts.packed is not None) == (fp32_kernels == "off" and can_pack(torch.bfloat16))
    hf = load_hf(model_dir)
    rng = random.Random(3)
    prompt = [rng.randrange(3, 500) for _ in range(40)]
    ref = hf_last_logits(hf, prompt)
    place_rows(runner, [prompt])
    out = runner.forward(Batch(rows=[0], starts=[0], ends=[40], params=[GREEDY], steps=[0]))
    assert (out.logits[0] - ref).abs().max() <= 0.15 * ref.abs().max()
    assert int(out.next_tokens[0]) == int(ref.argmax())


def _naive_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
               weights: torch.Tensor) -> torch.Tensor:
    """Token by token, in float64: the definition."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = silu_mul(x[t].double() @ w13[e].double().T)
            out[t] += float(weights[t, j]) * (h @ w2[e].double().T)
    return out


def _random_moe(tokens: int, hidden: int = 64, inter: int = 32, seed: int = 0
                ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(EXPERTS, 2 * inter, hidden, generator=gen) * 0.1
    w2 = torch.randn(EXPERTS, hidden, inter, generator=gen) * 0.1
    probs = torch.softmax(torch.randn(tokens, EXPERTS, generator=gen), -1)
    weights, ids = torch.topk(probs, TOP_K, dim=-1)
    return x, w13, w2, ids, weights


@pytest.mark.parametrize("tokens", [3, 300])
def test_cpu_experts_run_each_expert_once_over_its_tokens(
        tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """At most two products per expert whatever the token count, all k * T rows in them."""
    x, w13, w2, ids, weights = _random_moe(tokens)
    rows: list[tuple[int, int]] = []
    product = fused_moe.expert_linear

    def counted(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        rows.append((w.data_ptr(), a.shape[0]))
        return product(a, w)

    monkeypatch.setattr(fused_moe, "expert_linear", counted)
    got = fused_moe.grouped_moe(x, w13, w2, ids, weights, silu_mul)
    assert len(rows) <= 2 * EXPERTS
    assert len({ptr for ptr, _ in rows}) == len(rows)  # no expert's weight twice
    assert sum(n for _, n in rows) == 2 * TOP_K * tokens
    assert torch.allclose(got.double(), _naive_moe(x, w13, w2, ids, weights), atol=1e-5)


_TRITON_CHECK = """
import torch
from asyncinfer.layers import fused_moe, triton_moe
from asyncinfer.layers.fused import silu_mul
from asyncinfer.layers.linear import can_pack
from asyncinfer.params import SamplingParams
from tests.test_moe import _random_moe

x, w13, w2, ids, weights = _random_moe(19, hidden=48, inter=24, seed=1)
ids[ids == 5] = 6  # expert 5 gets no token
assert triton_moe.available(x.device)
got = triton_moe.fused_moe(x, w13, w2, ids, weights, silu_mul)
want = fused_moe.grouped_moe(x, w13, w2, ids, weights, silu_mul)
print("max error", float((got - want).abs().max()))
assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
"""


def test_triton_fused_moe_equals_the_torch_reference() -> None:
    """The CUDA kernel under Triton's interpreter on CPU (set before triton loads, so in a
    process of its own): tiny shapes, blocks that straddle experts, an expert with no
    token."""
    assert "max error" in run_interpreted(_TRITON_CHECK, "the fused MoE kernel")


@pytest.mark.parametrize("fields, named", [
    ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size=64"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ({"use_sliding_window": True, "sliding_window": 64, "layer_types": None,
      "max_window_layers": 0}, "sliding_window=64"),
])
def test_a_qwen3_moe_field_that_is_not_implemented_is_refused_by_name(
        qwen3_moe_dir: Path, tmp_path: Path, fields: dict[str, Any], named: str) -> None:
    model_dir = _edited(qwen3_moe_dir, tmp_path / "model", **fields)
    with pytest.raises(UnsupportedModelError, match=re.escape(named)):
        LLM(str(model_dir), skip_tokenizer_init=True, dtype="float32", num_pages=64,
            max_seq_len=256)


def test_the_cpu_moe_benchmark_shape_runs_on_dummy_weights(tmp_path: Path) -> None:
    """``--shape qwen3-moe-tiny``: the engine builds it and generates every token asked."""
    from asyncinfer.bench.throughput import shape_dir

    llm = LLM(str(shape_dir("qwen3-moe-tiny", tmp_path)), skip_tokenizer_init=True,
              load_format="dummy", max_seq_len=128, num_pages=64)
    try:
        outputs = llm.generate([[5, 6, 7], list(range(3, 40))],
                               SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
        assert [len(o.token_ids) for o in outputs] == [4, 4]
    finally:
        llm.close()


def test_an_expert_width_the_ranks_do_not_divide_is_refused_before_they_start(
        qwen3_moe_dir: Path, tmp_path: Path) -> None:
    """Heads and the dense width split over 2; the experts' width of 33 does not."""
    import multiprocessing

    model_dir = _edited(qwen3_moe_dir, tmp_path / "model", moe_intermediate_size=33)
    with pytest.raises(ConfigError, match="does not divide the model's MLP width"):
        LLM(str(model_dir), skip_tokenizer_init=True, dtype="float32", num_pages=64,
            tensor_parallel_size=2)
    assert not multiprocessing.active_children()
