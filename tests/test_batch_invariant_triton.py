"""The batch-invariant mode's CUDA path on the CPU: its Triton kernels under Triton's
interpreter (against torch, and bit for bit across batch sizes, chunkings and cache states),
the engine through them end to end (float32 tokens equal to transformers'; bf16 tokens and
logprobs the same alone, batched, chunked and after a cache hit), and each kernel compiled
for an H200 (sm_90), which needs no GPU. Its run on a GPU is the H200 issue's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncinfer.config import EngineConfig
from asyncinfer.engine.invariant import check_batch_invariant
from asyncinfer.errors import ConfigError
from asyncinfer.kernels import triton_invariant as ti

pytestmark = pytest.mark.skipif(ti.triton is None, reason="triton is not installed")

ROOT = Path(__file__).parent.parent


def _interpreted(*args: str) -> str:
    """``tests.triton_invariant_checks`` with ``args`` in a process of its own, where
    ``TRITON_INTERPRET=1`` is set before triton loads; its output."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "tests.triton_invariant_checks", *args],
                          env=env, timeout=900, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def test_the_kernels_match_torch_and_give_each_row_the_same_bits_in_any_batch() -> None:
    out = _interpreted("kernels")
    for name in ("products", "norms", "attention", "softmax"):
        assert f"{name}: ok" in out


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama small enough for the interpreter (GQA, a tied head)."""
    from transformers import LlamaConfig

    from tests.conftest import _save_tiny

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         eos_token_id=1, bos_token_id=0)
    return _save_tiny(config, tmp_path_factory.mktemp("small-llama"))


def test_the_engine_through_the_cuda_path_is_exact_in_float32_and_invariant_in_bf16(
        small_llama: Path) -> None:
    out = _interpreted("engine", str(small_llama))
    assert "engine float32 = transformers: ok" in out
    assert "engine bf16 invariant: ok" in out


def _sm90(kernel: Any, signature: dict[str, str], constants: dict[str, Any],
          warps: int, stages: int = 1) -> dict[str, Any]:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    full = {**signature, **{name: "constexpr" for name in constants}}
    compiled = ti.triton.compile(ASTSource(fn=kernel, signature=full, constexprs=constants),
                                 target=GPUTarget("cuda", 90, 32),
                                 options={"num_warps": warps, "num_stages": stages})
    return dict(compiled.asm)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_every_kernel_compiles_for_an_h200(dtype: str) -> None:
    """Triton to PTX to a cubin for sm_90, with the launch settings of kernels.triton_invariant
    (what Triton's interpreter does not check: types, layouts, the tensor-core products)."""
    precision = "ieee" if dtype == "fp32" else "tf32"
    p = f"*{dtype}"
    builds = [
        _sm90(ti._matmul_kernel,
              {"x": p, "w": p, "bias": p, "out": p, "rows": "i32", "cols": "i32",
               "depth": "i32", "x_stride": "i32", "w_stride": "i32", "out_stride": "i32"},
              {"HAS_BIAS": True, "BLOCK_M": ti.BLOCK_M, "BLOCK_N": ti.BLOCK_N,
               "BLOCK_K": ti.BLOCK_K, "PRECISION": precision, "UPCAST": False}, 4, 2),
        _sm90(ti._rms_norm_kernel,
              {"x": p, "x_stride": "i32", "residual": p, "residual_stride": "i32",
               "weight": p, "out": p, "out_stride": "i32", "summed": p,
               "summed_stride": "i32", "width": "i32", "eps": "fp32"},
              {"ADD": True, "OFFSET": False, "BLOCK": 4096}, 4),
        _sm90(ti._attention_kernel,
              {"q": p, "q_stride": "i32", "k_pool": p, "v_pool": p, "pool_stride": "i32",
               "table": "*i64", "table_stride": "i32", "rows": "*i64", "lens": "*i64",
               "out": p, "out_stride": "i32", "scale": "fp32", "window": "i32"},
              {"GROUP": 4, "GROUP_PAD": 16, "DIM": 128, "DIM_PAD": 128,
               "BLOCK_N": ti.KEY_BLOCK, "WINDOWED": True, "PRECISION": precision,
               "UPCAST": False}, 4),
        _sm90(ti._softmax_kernel,
              {"x": p, "x_stride": "i32", "inv_temperature": "*fp32", "out": "*fp32",
               "out_stride": "i32", "width": "i32"},
              {"LOG": True, "SCALED": True, "BLOCK": ti.SOFTMAX_BLOCK}, 8),
    ]
    for asm in builds:
        assert len(asm["cubin"]) > 0
        assert ".target sm_90" in asm["ptx"]
    if dtype == "bf16":  # the products run on tensor cores
        assert "mma" in builds[0]["ptx"] or "wgmma" in builds[0]["ptx"]


def test_the_mode_on_cuda_is_refused_with_flashinfer_and_past_two_ranks() -> None:
    cuda = torch.device("cuda", 0)
    with pytest.raises(ConfigError, match="flashinfer"):
        check_batch_invariant(EngineConfig(device="cuda", batch_invariant=True,
                                           attention_backend="flashinfer"),
                              cuda, torch.bfloat16, None)
    with pytest.raises(ConfigError, match="two tensor-parallel ranks"):
        check_batch_invariant(EngineConfig(device="cuda", batch_invariant=True,
                                           tensor_parallel_size=4),
                              cuda, torch.bfloat16, None)
    auto = EngineConfig(device="cuda", batch_invariant=True)
    assert auto.resolved_attention_backend == "torch"
