"""Mixture of experts on a GPU: the Triton fused MoE against the grouped torch reference at
the Qwen3-30B-A3B layer's shape (128 experts, top 8), and a Qwen3-MoE trained on
alternation through flashinfer (eager and in CUDA graphs) giving the torch backend's tokens,
and float32 on CUDA giving transformers' greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncinfer.layers import fused_moe, triton_moe
from asyncinfer.layers.fused import silu_mul
from tests.gpu.conftest import _TRAINED_SHAPE, _train_alternation, alternating, needs_gpu
from tests.gpu.test_gpu_engine import alternation_prompts, generate
from tests.hf_reference import hf_greedy, load_hf

pytestmark = [pytest.mark.gpu, needs_gpu]


@pytest.mark.parametrize("tokens", [1, 7, 64, 513])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_fused_moe_at_the_30b_layer_shape(tokens: int, dtype: torch.dtype) -> None:
    experts, top_k, hidden, inter = 128, 8, 2048, 768
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.02).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * 0.02).to(dtype)
    probs = torch.softmax(torch.randn(tokens, experts, device="cuda", generator=gen), -1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    assert triton_moe.available(x.device)
    got = triton_moe.fused_moe(x, w13, w2, ids, weights.to(dtype), silu_mul).float()
    want = fused_moe.grouped_moe(x, w13, w2, ids, weights.to(dtype), silu_mul).float()
    scale = want.abs().max()
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert (got - want).abs().max() <= tolerance * scale


@pytest.fixture(scope="module")
def trained_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3MoeConfig

    return _train_alternation(
        Qwen3MoeConfig(num_attention_heads=4, tie_word_embeddings=False,
                       moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4,
                       norm_topk_prob=True, **_TRAINED_SHAPE),
        tmp_path_factory.mktemp("trained-qwen3-moe"))


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_flashinfer_moe_equals_torch_backend(trained_moe_dir: Path, cuda_graph: bool) -> None:
    prompts = alternation_prompts()
    ours, llm = generate(trained_moe_dir, prompts, attention_backend="flashinfer",
                         cuda_graph=cuda_graph)
    llm.close()
    reference, llm = generate(trained_moe_dir, prompts, attention_backend="torch",
                              cuda_graph=False)
    llm.close()
    assert ours == reference
    assert ours == [alternating((p[len(p) % 2], p[(len(p) + 1) % 2]), len(ours[0]))
                    for p in prompts]


def test_float32_moe_on_cuda_is_transformers_greedy(trained_moe_dir: Path) -> None:
    prompts = alternation_prompts(n=6)
    ours, llm = generate(trained_moe_dir, prompts, dtype="float32", attention_backend="torch",
                         cuda_graph=False)
    llm.close()
    hf = load_hf(trained_moe_dir)
    assert ours == [hf_greedy(hf, p, len(ours[0])) for p in prompts]
