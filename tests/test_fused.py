"""The fused layer and sampling ops: traced whole by torch.compile, and the same tokens.

On a CPU the compiled path is traced with the "aot_eager" backend (dynamo and AOT
autograd, no code generation), which is what must hold for the inductor kernels on CUDA:
no graph break, and the arithmetic of the eager functions. The GPU suite runs inductor.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from asyncinfer.api import LLM
from asyncinfer.engine.sampler import Sampler, gumbel_noise
from asyncinfer.params import SamplingParams
from tests.test_model_outputs import GREEDY, reference


def _llm(model_dir: Path, compile_ops: bool) -> LLM:
    llm = LLM(str(model_dir), skip_tokenizer_init=True, dtype="float32",
              max_running_requests=8, max_seq_len=256, num_pages=400)
    if compile_ops:
        llm.runner.compile_layer_ops(backend="aot_eager")
        llm.runner.sampler = Sampler(0, compile=True, backend="aot_eager")
    return llm


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_compiled_layer_ops_give_transformers_tokens(
        model: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(model)
    prompts, expected = reference(model_dir)
    llm = _llm(model_dir, compile_ops=True)
    assert llm.runner.model.ops.compiled
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected


def test_compiled_sampler_draws_what_the_eager_one_draws() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1)).bfloat16()
    params = [SamplingParams(temperature=t, seed=s)
              for t, s in [(0.6, None), (0.0, None), (1.0, 5), (2.0, None), (0.3, 9), (0, 1)]]
    steps = [0, 1, 2, 3, 4, 5]
    for _ in range(3):  # first sizes static, then dynamic: every compile must agree
        eager = Sampler(3).sample(logits, params, steps)
        fused = Sampler(3, compile=True, backend="aot_eager").sample(logits, params, steps)
        assert torch.equal(eager, fused)
        logits, params, steps = logits[1:], params[1:], steps[1:]


def test_gumbel_noise_is_pinned_and_distributed_as_gumbel() -> None:
    keys = torch.tensor([0, -1, 2**40 + 3], dtype=torch.int64)
    noise = gumbel_noise(keys, 1 << 16)
    # Pinned like request_seed: a change here changes every sampled token.
    assert noise[0, :3].tolist() == pytest.approx([-2.81154, -0.05545, -0.43820], abs=1e-4)
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[1], noise[2])
    assert torch.isfinite(noise).all()
    # Gumbel(0, 1): mean is Euler's gamma, variance pi^2 / 6.
    assert noise.mean().item() == pytest.approx(0.5772, abs=0.01)
    assert noise.var().item() == pytest.approx(math.pi**2 / 6, abs=0.03)
    # Uniform over the support: every 23-bit hash bucket of one row is hit about equally.
    top = (noise[0] > noise[0].median()).float().mean().item()
    assert top == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("c", [0x7FEB352D, 0x846CA68B, 0xFFFFFFFF, 0x80000000, 1])
def test_mul32_is_the_low_half_of_the_exact_product(c: int) -> None:
    from asyncinfer.engine.sampler import _mul32

    rng = random.Random(c)
    values = [0, 1, 2**31, 2**32 - 1] + [rng.getrandbits(32) for _ in range(2000)]
    got = _mul32(torch.tensor(values, dtype=torch.int64), c)
    assert got.tolist() == [(v * c) & 0xFFFFFFFF for v in values]

