"""The CPU decode-attention kernel (asyncinfer.attention.native) against torch's SDPA over
gathered K and V, in float32 and over a bfloat16 pool, built for AVX2 (x86-64-v3) and for
this CPU (-march=native: AVX-512 with bf16 units where there are): each build is pinned to
the reference, and the builds to each other."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from asyncinfer.attention import native


def _cpu_has(flag: str) -> bool:
    return flag in native._cpu_flags().split()


BUILDS = ["native", pytest.param("x86-64-v3", marks=pytest.mark.skipif(
    not _cpu_has("avx2"), reason="needs AVX2"))]


def _case(dtype: torch.dtype, heads: int, kv_heads: int, dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    batch, page, longest = 7, 16, 70
    width = (longest // page + 2) * page
    k = torch.randn(batch * width, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(batch * width, kv_heads, dim, generator=gen).to(dtype)
    # Rows hold scattered pages, as the allocator leaves them after a while.
    pages = torch.randperm(batch * width // page, generator=gen).view(batch, -1)
    table = (pages[:, :, None] * page + torch.arange(page)).view(batch, -1).contiguous()
    rows = torch.randperm(batch, generator=gen)
    lens = torch.tensor([1, 2, 15, 16, 17, 40, longest])
    q = torch.randn(batch, heads, dim, generator=gen)
    return q, k, v, table, rows, lens


def _reference(q, k, v, table, rows, lens, scale):
    outs = []
    for i in range(q.shape[0]):
        slots = table[rows[i], : lens[i]]
        outs.append(F.scaled_dot_product_attention(
            q[i].unsqueeze(1), k[slots].float().transpose(0, 1),
            v[slots].float().transpose(0, 1), scale=scale, enable_gqa=True).squeeze(1))
    return torch.stack(outs)


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 128), (6, 2, 48)])
def test_decode_attention_equals_sdpa_over_gathered_kv(march: str, dtype: torch.dtype,
                                                       heads: int, kv_heads: int,
                                                       dim: int) -> None:
    kernels = native.load(march)
    if kernels is None:
        pytest.skip(f"no C compiler for -march={march}")
    q, k, v, table, rows, lens = _case(dtype, heads, kv_heads, dim)
    scale = dim**-0.5
    out = kernels.decode_attention(q, k, v, table, rows, lens, scale, int(lens.max()))
    torch.testing.assert_close(out, _reference(q, k, v, table, rows, lens, scale),
                               rtol=1e-5, atol=2e-6)


def test_the_avx2_and_native_builds_agree_and_outputs_do_not_depend_on_the_batch() -> None:
    if not _cpu_has("avx2"):
        pytest.skip("needs AVX2")
    avx2, here = native.load("x86-64-v3"), native.load("native")
    if avx2 is None or here is None:
        pytest.skip("no C compiler")
    q, k, v, table, rows, lens = _case(torch.bfloat16, 9, 3, 64, seed=1)
    a = avx2.decode_attention(q, k, v, table, rows, lens, 0.125, int(lens.max()))
    b = here.decode_attention(q, k, v, table, rows, lens, 0.125, int(lens.max()))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # One request alone gives exactly what it gave in the batch.
    alone = here.decode_attention(q[3:4], k, v, table, rows[3:4], lens[3:4], 0.125,
                                  int(lens[3]))
    assert torch.equal(alone[0], b[3])


def test_the_engine_uses_the_kernel_on_cpu_and_gives_the_gather_paths_tokens(
        smollm2_dir) -> None:
    """float32, trained weights: a bf16 run (or a random model's near-ties) may round one
    score differently from SDPA and flip a greedy token."""
    from asyncinfer import LLM, SamplingParams

    prompts = [[1, 504, 3458, 282, 4649, 314] * (i + 1) for i in range(5)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = []
    for cpu_kernels in (True, False):
        llm = LLM(str(smollm2_dir), skip_tokenizer_init=True, cpu_kernels=cpu_kernels,
                  max_running_requests=8, max_seq_len=256,
                  dtype="float32")
        assert (llm.engine.runner.backend.native is not None) == (
            cpu_kernels and native.load() is not None)
        outputs.append([o.token_ids for o in llm.generate(prompts, [params] * 5,
                                                          use_tqdm=False)])
        llm.close()
    assert outputs[0] == outputs[1]
