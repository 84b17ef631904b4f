"""The CPU decode-attention kernel (asyncinfer.kernels.cpu) against torch's SDPA over
gathered K and V, in float32 and over a bfloat16 pool, built for AVX2 (x86-64-v3) and for
this CPU (-march=native: AVX-512 with bf16 units where there are): each build is pinned to
the reference, and the builds to each other. The layer ops (norms, rotary with the KV
store, SiLU) against layers.fused's torch code in bfloat16, the builds bit for bit to each
other; the AMX matrix product against torch's bf16 linear; and the bf16 engine on all the
kernels against float32 transformers."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from asyncinfer.kernels import cpu as native


def _cpu_has(flag: str) -> bool:
    return flag in native.cpu_flags().split()


BUILDS = ["native", pytest.param("x86-64-v3", marks=pytest.mark.skipif(
    not _cpu_has("avx2"), reason="needs AVX2"))]


def _build(march: str) -> native.NativeKernels:
    """The kernels built for ``march``; the test is skipped where they cannot be built."""
    kernels = native.load(march)
    if kernels is None:
        pytest.skip(f"no C compiler for -march={march}")
    return kernels


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
@pytest.mark.parametrize(("heads", "kv_heads", "dim"),
                         [(9, 3, 64), (4, 4, 128), (6, 2, 48), (8, 2, 64), (4, 2, 128),
                          (12, 2, 64)])
def test_decode_attention_equals_sdpa_over_gathered_kv(march: str, dtype: torch.dtype,
                                                       heads: int, kv_heads: int,
                                                       dim: int) -> None:
    kernels = _build(march)
    q, k, v, table, rows, lens = _case(dtype, heads, kv_heads, dim)
    scale = dim**-0.5
    out = kernels.decode_attention(q, k, v, table, rows, lens, scale, int(lens.max()))
    torch.testing.assert_close(out, _reference(q, k, v, table, rows, lens, scale),
                               rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_of_bf16_queries_is_the_float32_result_rounded(
        march: str, dtype: torch.dtype) -> None:
    """bf16 queries in, bf16 out: the float32 computation of the same (widened) queries,
    rounded once, bit for bit; the dims of 48 take the unblocked path."""
    kernels = _build(march)
    for heads, kv_heads, dim in ((9, 3, 64), (6, 2, 48)):
        q, k, v, table, rows, lens = _case(dtype, heads, kv_heads, dim, seed=2)
        q = q.bfloat16()
        out = kernels.decode_attention(q, k, v, table, rows, lens, 0.125, int(lens.max()))
        wide = kernels.decode_attention(q.float(), k, v, table, rows, lens, 0.125,
                                        int(lens.max()))
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, wide.bfloat16())


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"),
                         [(9, 3, 64), (4, 4, 128), (6, 2, 48), (4, 2, 40), (8, 2, 64),
                          (4, 2, 128), (12, 2, 64)])
def test_a_chunks_queries_attended_together_give_each_querys_own_bits(
        march: str, dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> None:
    """The batch-invariant mode's prefill: every new token one query at its own position.
    The kernel attends one request's consecutive queries together; each query's output must
    be exactly what it gives alone, in bf16 and float32 io, with and without a window, and
    SDPA's within float32 rounding. Chunks from position 0 and after a cached prefix,
    shorter and longer than a run, ending inside a key block and on its edge."""
    kernels = _build(march)
    gen = torch.Generator().manual_seed(5)
    chunks = [(0, 1), (0, 40), (5, 17), (16, 16), (33, 3), (0, 70), (2, 30)]
    page, width = 16, 128
    n = len(chunks)
    k = torch.randn(n * width, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(n * width, kv_heads, dim, generator=gen).to(dtype)
    pages = torch.randperm(n * width // page, generator=gen).view(n, -1)
    table = (pages[:, :, None] * page + torch.arange(page)).view(n, -1).contiguous()
    rows = torch.cat([torch.full((new,), i, dtype=torch.int64)
                      for i, (_, new) in enumerate(chunks)])
    lens = torch.cat([torch.arange(start + 1, start + new + 1, dtype=torch.int64)
                      for start, new in chunks])
    q = torch.randn(rows.shape[0], heads, dim, generator=gen)
    longest, scale = int(lens.max()), dim**-0.5
    for queries in (q, q.bfloat16()):
        for window in (None, 20):
            together = kernels.decode_attention(queries, k, v, table, rows, lens, scale,
                                                longest, window)
            alone = torch.cat([kernels.decode_attention(
                queries[i:i + 1], k, v, table, rows[i:i + 1], lens[i:i + 1], scale,
                int(lens[i]), window) for i in range(rows.shape[0])])
            assert torch.equal(together, alone)
    out = kernels.decode_attention(q, k, v, table, rows, lens, scale, longest)
    torch.testing.assert_close(out, _reference(q, k, v, table, rows, lens, scale),
                               rtol=1e-5, atol=2e-6)


def test_the_avx2_and_native_builds_agree_and_outputs_do_not_depend_on_the_batch() -> None:
    if not _cpu_has("avx2"):
        pytest.skip("needs AVX2")
    avx2, here = _build("x86-64-v3"), _build("native")
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


# ---- the layer ops (bfloat16 activations) against layers.fused's torch code ----

def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between a and b in bfloat16 steps (same-sign values)."""
    bits = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
    return int(bits.max())


def _close_to_torch(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    # Our RMSNorm sums its squares in another order than torch (whose own order differs
    # between its AVX2 and AVX-512 code), and SiLU's exp is ours: a rare normalized value
    # rounds one step the other way, which the weight's product may widen to two.
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert _bf16_ulps(ours, theirs) <= 2
    assert (ours != theirs).float().mean().item() <= 1e-3


def _rope_case(tokens: int, heads: int, kv_heads: int, dim: int, qk_norm: bool):
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).bfloat16()
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    freqs = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
    angles = positions[:, None].float() * freqs[None]
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = (f(angles).bfloat16().unsqueeze(1) for f in (torch.cos, torch.sin))
    weights = [(1 + 0.1 * torch.randn(dim, generator=gen)).bfloat16() if qk_norm else None
               for _ in range(2)]
    slots = torch.randperm(4 * tokens, generator=gen)[:tokens]
    return qkv, cos, sin, weights, slots


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("tokens", [1, 37])
def test_norms_and_silu_equal_torchs_bf16(march: str, tokens: int) -> None:
    from asyncinfer.layers import fused

    kernels = _build(march)
    gen = torch.Generator().manual_seed(7)
    x, residual = (torch.randn(tokens, 576, generator=gen).bfloat16() for _ in range(2))
    weight = (1 + 0.1 * torch.randn(576, generator=gen)).bfloat16()
    out, stream = kernels.add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_stream = fused.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(stream, ref_stream)  # one bf16 add: exactly torch's
    _close_to_torch(out, ref_out)
    # A view with a row stride (a slice of a wider product) reads as the rows it holds.
    wide = torch.randn(tokens, 2 * 576, generator=gen).bfloat16()
    out, same = kernels.add_rms_norm(wide[:, :576], None, weight, 1e-5)
    assert same.data_ptr() == wide.data_ptr()
    rows = wide[:, :576].contiguous()
    assert torch.equal(out, kernels.add_rms_norm(rows, None, weight, 1e-5)[0])
    _close_to_torch(out, fused.rms_norm(rows, weight, 1e-5))
    gate_up = (3 * torch.randn(tokens, 2 * 1536, generator=gen)).bfloat16()
    _close_to_torch(kernels.silu_mul(gate_up), fused.silu_mul(gate_up))


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
def test_rope_and_kv_store_equal_torchs_bf16(march: str, qk_norm: bool,
                                             cache_dtype: torch.dtype) -> None:
    from asyncinfer.layers import fused

    kernels = _build(march)
    heads, kv_heads, dim, tokens = 8, 2, 128, 19
    qkv, cos, sin, (q_w, k_w), slots = _rope_case(tokens, heads, kv_heads, dim, qk_norm)
    caches = [torch.full((4 * tokens, kv_heads, dim), 7.0, dtype=cache_dtype)
              for _ in range(4)]
    ours = kernels.qk_norm_rope_store(qkv, cos, sin, q_w, k_w, 1e-6, heads, kv_heads, dim,
                                      caches[0], caches[1], slots)
    theirs = fused.qk_norm_rope_store(qkv, cos, sin, q_w, k_w, 1e-6, heads, kv_heads, dim,
                                      caches[2], caches[3], slots)
    for a, b in zip(ours, theirs):
        if qk_norm:
            _close_to_torch(a, b)
        else:  # products and sums of bf16 values, each rounded as torch rounds it
            assert torch.equal(a, b)
    assert torch.equal(caches[1], caches[3])  # v is copied
    stored = caches[0][slots].to(torch.bfloat16)
    assert torch.equal(stored, ours[1])  # k lands in its slots
    untouched = torch.ones(4 * tokens, dtype=torch.bool)
    untouched[slots] = False
    assert bool((caches[0][untouched] == 7.0).all())


def test_the_avx2_and_native_layer_ops_give_the_same_bits() -> None:
    if not _cpu_has("avx2"):
        pytest.skip("needs AVX2")
    avx2, here = _build("x86-64-v3"), _build("native")
    gen = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(23, 960, generator=gen).bfloat16() for _ in range(2))
    weight = torch.randn(960, generator=gen).bfloat16()
    for a, b in zip(avx2.add_rms_norm(x, residual, weight, 1e-6),
                    here.add_rms_norm(x, residual, weight, 1e-6)):
        assert torch.equal(a, b)
    gate_up = (4 * torch.randn(23, 2 * 2560, generator=gen)).bfloat16()
    assert torch.equal(avx2.silu_mul(gate_up), here.silu_mul(gate_up))
    qkv, cos, sin, (q_w, k_w), slots = _rope_case(23, 16, 8, 64, True)
    outs = []
    for kernels in (avx2, here):
        caches = [torch.zeros(4 * 23, 8, 64, dtype=torch.bfloat16) for _ in range(2)]
        q, k, _ = kernels.qk_norm_rope_store(qkv, cos, sin, q_w, k_w, 1e-6, 16, 8, 64,
                                             *caches, slots)
        outs.append((q, k, *caches))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def _bf16_decode_logits(model_dir, seqs, cpu_kernels: bool):
    from asyncinfer.config import EngineConfig
    from asyncinfer.core import Batch
    from asyncinfer.engine.runner import ModelRunner
    from asyncinfer.params import SamplingParams
    from tests.hf_reference import place_rows

    config = EngineConfig(dtype="bfloat16", page_size=16, max_running_requests=16,
                          max_seq_len=255, num_pages=512, cpu_kernels=cpu_kernels)
    runner = ModelRunner(config, model_dir)
    place_rows(runner, seqs)
    n, greedy = len(seqs), SamplingParams(temperature=0.0)
    runner.forward(Batch(rows=list(range(n)), starts=[0] * n, ends=[len(s) - 1 for s in seqs],
                         params=[greedy] * n, steps=[0] * n, sample=[False] * n))
    decode = Batch(rows=list(range(n)), starts=[len(s) - 1 for s in seqs],
                   ends=[len(s) for s in seqs], params=[greedy] * n, steps=[0] * n,
                   sample=[False] * n)
    return runner, runner.forward(decode).logits


@pytest.mark.parametrize("plain_copy", [True, False])
def test_the_bf16_engine_on_the_kernels_is_as_close_to_fp32_transformers_as_torchs(
        smollm2_dir, plain_copy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 with the CPU kernels (decode attention, layer ops, and packed weights where
    oneDNN has native bf16: beside the plain ones, or alone as when memory is short)
    against the same engine on torch's ops (prompts through the AMX prefill attention
    where it builds), both measured against transformers in
    float32: the kernels' logits are no further from it on average. (Greedy tokens cannot be
    compared: bf16 rounding flips near-ties either way. Nor can the worst sequence alone:
    a one-ulp difference in a norm's sum, which the kernels may round in another order, grows
    over 30 layers into a different error for one sequence, either way.)"""
    import random

    from asyncinfer.layers import packing

    if not plain_copy:
        monkeypatch.setattr(packing, "keeps_both_copies", lambda weight_bytes: False)

    from asyncinfer.kernels.cpu import NativeKernels
    from asyncinfer.layers.linear import can_pack
    from tests.hf_reference import hf_last_logits, load_hf

    rng = random.Random(5)
    seqs = [[rng.randrange(3, 5000) for _ in range(rng.randrange(2, 120))] for _ in range(12)]
    hf = load_hf(smollm2_dir)
    ref = torch.stack([hf_last_logits(hf, seq) for seq in seqs])
    errors, agreements = [], []
    for cpu_kernels in (True, False):
        runner, logits = _bf16_decode_logits(smollm2_dir, seqs, cpu_kernels)
        uses = isinstance(getattr(runner.model.ops.act, "__self__", None), NativeKernels)
        kernels = native.load()
        assert uses == (cpu_kernels and kernels is not None)
        # Prompts take the AMX prefill kernel where it builds (SmolLM2: 9 heads of 64 on 3).
        assert runner.backend.native_prefill == (
            cpu_kernels and kernels is not None
            and kernels.runs_prefill(torch.bfloat16, 9, 3, 64))
        down = runner.model.layers[0].mlp.down_proj
        # The plain weight goes where a packed copy takes its place, or a float32 shadow
        # (a CPU without bf16 units multiplies in float32 kernels).
        assert (down.weight.numel() == 0) == (
            runner.config.fp32_kernels or (not plain_copy and can_pack(torch.bfloat16)))
        errors.append((logits - ref).abs().amax(-1) / ref.abs().amax(-1))
        agreements.append((logits.argmax(-1) == ref.argmax(-1)).float().mean().item())
    kernel_errors, torch_errors = errors
    assert kernel_errors.mean() <= 1.1 * torch_errors.mean()
    assert kernel_errors.max() <= 2 * torch_errors.max()
    assert agreements[0] >= agreements[1]


@pytest.mark.parametrize("march", BUILDS)
def test_argmax_equals_torchs_with_ties_and_nans(march: str) -> None:
    kernels = _build(march)
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(9, 49152, generator=gen)
    logits[1, [7, 300, 40000]] = 50.0                   # equal maxima: the first wins
    logits[2, [12, 9000]] = float("nan")                # a NaN wins, the first of them
    logits[3] = float("-inf")                           # all -inf: index 0
    logits[4, -1] = 99.0                                # the last column
    assert torch.equal(kernels.argmax(logits), logits.argmax(dim=-1))
    half = logits.bfloat16()                            # widened first, as torch's path
    assert torch.equal(kernels.argmax(half), half.float().argmax(dim=-1))
    # Widths with a tail past the sixteen lanes, and shorter than them; ties in lanes other
    # than the first's, and between the lanes and the tail.
    for width in (49155, 40, 7):
        rows = torch.randn(6, width, generator=gen)
        rows[0, [17 % width, 3]] = 9.0
        rows[1, [width - 1, width - 2]] = 9.0
        rows[2, [0, width - 1]] = 9.0
        rows[3, width - 1] = float("nan")
        rows[4] = float("-inf")
        rows[5, :] = 1.0
        assert torch.equal(kernels.argmax(rows), rows.argmax(dim=-1)), width


@pytest.mark.parametrize("march", BUILDS)
def test_the_race_and_its_noise_equal_the_samplers_torch_code(march: str) -> None:
    from asyncinfer.engine import sampler

    kernels = _build(march)
    gen = torch.Generator().manual_seed(12)
    for width in (49152, 49155, 40, 7):
        rows = 48
        logits = 3 * torch.randn(rows, width, generator=gen)
        keys = torch.randint(-2**63, 2**63 - 1, (rows,), generator=gen)
        keys[:4] = torch.tensor([0, -1, 2**32, -2**63])         # the key's halves' ends
        inv_t = torch.tensor([0.0, 1.0, 0.5, 4.0] * (rows // 4))  # greedy rows beside
        logits[5, width // 2] = float("nan")                     # a NaN logit wins
        logits[6] = float("-inf")                                # as torch: index 0
        logits[7, [1 % width, width - 1]] = 1e4                  # equal winners: the first
        logits[8, [0, width - 1]] = 1e4                          # a greedy row's tie
        noise = kernels.gumbel_noise(keys, width)
        theirs = sampler.gumbel_noise(keys, width)
        assert noise.shape == theirs.shape and noise.dtype == torch.float32
        # The same uniforms; the logarithms within a few ulps of torch's.
        assert torch.allclose(noise, theirs, rtol=1e-6, atol=2e-6)
        assert torch.equal(kernels.race(logits, inv_t, keys),
                           sampler.race(logits, inv_t, keys)), width
        half = logits.bfloat16()                                 # widened first, as torch
        assert torch.equal(kernels.race(half, inv_t, keys), sampler.race(half, inv_t, keys))


def test_the_engine_samples_on_the_kernels_with_torchs_tokens(smollm2_dir) -> None:
    """Seeded requests at a temperature, with and without top-p (the race's noise alone):
    the same tokens from the kernels as from the sampler's torch code."""
    from asyncinfer import LLM, SamplingParams

    if native.load() is None:
        pytest.skip("no C compiler")
    prompts = [[1, 504, 3458, 282, 4649, 314] * (i + 1) for i in range(4)]
    params = [SamplingParams(max_tokens=10, temperature=t, top_p=p, seed=i, ignore_eos=True)
              for i, (t, p) in enumerate([(1.0, 1.0), (0.7, 1.0), (1.3, 0.9), (0.0, 1.0)])]
    outputs = []
    for cpu_kernels in (True, False):
        llm = LLM(str(smollm2_dir), skip_tokenizer_init=True, cpu_kernels=cpu_kernels,
                  max_running_requests=8, max_seq_len=256, dtype="float32")
        sampler = llm.engine.runner.sampler
        assert (sampler._race == native.load().race) == cpu_kernels
        outputs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.close()
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bitmask_mask_equals_xgrammars_kernel(march: str, dtype: torch.dtype) -> None:
    xgr = pytest.importorskip("xgrammar")
    kernels = _build(march)
    gen = torch.Generator().manual_seed(5)
    # A vocabulary that is not a whole number of words, rows with a stride (padded logits),
    # bitmask rows all clear, all set and random, and rows left out of the masked set.
    for vocab in (49152, 1007, 19):
        logits = torch.randn(9, vocab + 13, generator=gen).to(dtype)[:, :vocab + 5]
        words = (vocab + 31) // 32
        bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (9, words), generator=gen,
                                dtype=torch.int32)
        bitmask[2], bitmask[3] = 0, -1
        bitmask[6, : words // 2] = 0
        rows = [0, 2, 3, 6, 8]
        ours, theirs = logits.clone(), logits.clone()
        kernels.mask_rows(ours, bitmask, rows, vocab)
        xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab, indices=rows)
        assert torch.equal(ours, theirs), vocab
        assert torch.equal(ours[[1, 4, 5, 7]], logits[[1, 4, 5, 7]])   # not in rows
        assert torch.equal(ours[:, vocab:], logits[:, vocab:])         # past the vocabulary
        assert ours[2, :vocab].eq(float("-inf")).all() and torch.equal(ours[3], logits[3])


@pytest.mark.parametrize("keep_plain", [True, False])
def test_packed_weights_give_torchs_products_and_free_the_plain_copy_when_asked(
        keep_plain: bool) -> None:
    from asyncinfer.layers.linear import PACKED_ROWS, Linear, can_pack

    if not can_pack(torch.bfloat16):
        pytest.skip("oneDNN has no native bf16 on this CPU")
    gen = torch.Generator().manual_seed(2)
    linear = Linear(576, 960).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(960, 576, generator=gen))
    plain = linear.weight.detach().clone()
    inputs = [torch.randn(rows, 576, generator=gen).bfloat16()
              for rows in (1, 40, PACKED_ROWS + 100)]
    expected = [F.linear(x, plain) for x in inputs]
    linear.pack_for_cpu(64, keep_plain=keep_plain)
    assert linear.weight.numel() == (plain.numel() if keep_plain else 0)
    for x, want in zip(inputs, expected):
        got = linear(x)
        # The same oneDNN arithmetic, blocked for another size: a rare last-bit difference.
        assert _bf16_ulps(got, want) <= 1 and (got != want).float().mean() < 1e-3


# ---- our matrix products (AMX tiles, or AVX-512 over widened weights) against torch ----

@pytest.mark.parametrize("rows", [1, 5, 17, 32, 33, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_torchs_bf16_linear(rows: int, bias: bool) -> None:
    """Both sum in float32 and round once: the same bf16 results but where the order of the
    sums moves a value across a rounding boundary (one step, rarely). Row counts cover a
    partial tile (AMX) and partial steps of eight rows (AVX-512)."""
    kernels = _build("native")
    if kernels.products is None:
        pytest.skip("no AMX tile units or AVX-512 here")
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(80, 320, generator=gen).bfloat16()  # five blocks of 16 columns
    b = torch.randn(80, generator=gen).bfloat16() if bias else None
    # A view with a row stride, as the products' inputs sometimes are.
    x = torch.randn(rows, 400, generator=gen).bfloat16()[:, 40:360]
    out = kernels.linear(x, kernels.pack(weight), 80, b)
    _close_to_torch(out, F.linear(x, weight, b))


def test_the_avx512_product_rounds_as_torch_and_keeps_nan() -> None:
    """The AVX-512 kernel's float32 sums, rounded to nearest even as torch rounds, NaN kept:
    its results equal float32 products rounded by torch, bit for bit, on these inputs."""
    kernels = _build("native")
    if kernels.products != "avx512":
        pytest.skip("the AVX-512 product runs on AVX-512 CPUs without AMX")
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 64, generator=gen).bfloat16()
    x = torch.randn(13, 64, generator=gen).bfloat16()
    x[4, 7] = float("nan")
    out = kernels.linear(x, kernels.pack(weight), 96)
    want = F.linear(x.float(), weight.float()).bfloat16()
    assert out[4].isnan().all() and not out[torch.arange(13) != 4].isnan().any()
    assert torch.equal(out[torch.arange(13) != 4], want[torch.arange(13) != 4])


def test_the_dot_product_form_agrees_with_the_fma_form_and_not_with_the_batch() -> None:
    """On AVX512-BF16, the product as vdpbf16ps: float32 sums of the exact products, in
    pairs, so within a rounding step of the float32 product (as the FMA form is); a row's
    result is the same whether it is multiplied alone, among a decode's few rows or among
    200; NaN kept."""
    kernels = _build("native")
    if kernels.products != "avx512" or not kernels.dot_built:
        pytest.skip("the dot-product form runs on AVX-512 CPUs with AVX512-BF16, without AMX")
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(112, 576, generator=gen).bfloat16()  # seven blocks: a short panel
    bias = torch.randn(112, generator=gen).bfloat16()
    x = torch.randn(200, 640, generator=gen).bfloat16()[:, 32:608]  # a row stride
    x[9, 100] = float("nan")
    packed = kernels.pack(weight)
    chosen = kernels.dot
    try:
        kernels.dot = True
        dot = kernels.linear(x, packed, 112, bias)
        alone = [kernels.linear(x[r:r + 1], packed, 112, bias) for r in (0, 9, 57, 199)]
        # 9 to 32 rows go over k in slices (decode-sized): the same sums, in the same order.
        few = {start: kernels.linear(x[start:], packed, 112, bias)
               for start in (192, 191, 184, 176, 168, 167)}
        kernels.dot = False
        fma = kernels.linear(x, packed, 112, bias)
    finally:
        kernels.dot = chosen
    assert dot[9].isnan().all() and fma[9].isnan().all()
    keep = torch.arange(200) != 9
    # Rounded once from float32 sums: a bf16 step (2^-8 of the value) from the float32
    # product, or float32's own error where the sum cancels to nearly nothing.
    want = F.linear(x.float(), weight.float(), bias.float())
    for ours in (dot, fma):
        torch.testing.assert_close(ours[keep].float(), want[keep], rtol=2**-8, atol=1e-3)
    assert (dot[keep] != fma[keep]).float().mean().item() <= 0.02
    for r, row in zip((0, 9, 57, 199), alone, strict=True):
        assert torch.equal(row[0], dot[r]) if r != 9 else row.isnan().all()
    for start, rows in few.items():
        assert torch.equal(rows, dot[start:]), 200 - start


def test_the_engine_multiplies_on_our_kernels_where_the_cpu_has_them(smollm2_dir) -> None:
    """Every decode-sized product of a bf16 engine goes through our product kernel where
    one builds (the tied head included); elsewhere through oneDNN's packed weights, or
    torch's where the CPU has no native bf16. The AVX-512 kernel takes every size; so
    does the AVX2 one, which does a CPU without bf16 units' float32 products."""
    from asyncinfer.config import EngineConfig
    from asyncinfer.engine.runner import ModelRunner
    from asyncinfer.layers.linear import Linear, can_pack

    runner = ModelRunner(EngineConfig(dtype="bfloat16", max_running_requests=4,
                                      max_seq_len=128, num_pages=64), smollm2_dir)
    kernels = native.load()
    avx2 = (runner.config.fp32_kernels and kernels is not None
            and kernels.fixed_products == "avx2")
    ours = kernels is not None and (kernels.products is not None or avx2)
    packs = can_pack(torch.bfloat16) or avx2
    every_size = ours and (avx2 or kernels.products == "avx512")
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert linears
    for module in linears:
        packed = module.packed
        assert (packed is not None) == packs
        if packed is not None:
            assert (packed.kernels is not None) == ours
            assert (module.packed_rows is None) == (module.weight.numel() == 0 or every_size)
        if avx2:  # no float32 copy beside the packed bf16 one
            assert module.shadow is None and module.weight.numel() == 0
    head = runner.model.lm_head.packed  # SmolLM2 ties its head to the embedding
    assert (head is not None) == packs
    if head is not None:
        assert (head.kernels is not None) == ours
    if ours:  # our kernels' copies share one slab of huge pages
        bases = {m.packed.data.untyped_storage().data_ptr() for m in linears if m.packed}
        assert len(bases) == 1
    if every_size:  # the head too, at any number of rows
        from asyncinfer.layers.linear import PACKED_ROWS

        hidden = torch.randn(PACKED_ROWS + 8, 576).bfloat16()
        calls = []
        packed_call = type(head).__call__
        head_type = type(head)
        try:
            head_type.__call__ = lambda self, *a: calls.append(1) or packed_call(self, *a)
            logits = runner.model.compute_logits(hidden)
        finally:
            head_type.__call__ = packed_call
        assert calls
        # float32 sums rounded once to bf16: within a rounding step of the float32 product.
        want = F.linear(hidden.float(), runner.model.embed_tokens.weight.float())
        assert ((logits - want).abs() <= want.abs() * 2**-8 + 1e-3).all()


@pytest.mark.skipif(not _cpu_has("avx2") or not _cpu_has("fma"), reason="needs AVX2 and FMA")
def test_float32_products_take_the_avx2_kernel_where_it_takes_the_weight() -> None:
    """use_fp32_products with the AVX2 build: a weight of whole tiles is packed for it
    (its plain copy freed, no float32 shadow), any other gets a float32 shadow; both give
    the float32 product rounded once to bf16, at any number of rows."""
    from asyncinfer.layers.linear import Linear
    from asyncinfer.layers.packing import use_fp32_products

    kernels = _build("x86-64-v3")
    assert kernels.products is None and kernels.fixed_products == "avx2"
    gen = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(Linear(64, 48, bias=True), Linear(40, 48))
    with torch.no_grad():
        for module in model:
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen))
            if module.bias is not None:
                module.bias.copy_(torch.randn(module.bias.shape, generator=gen))
    model.bfloat16()
    plain = [(m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone())
             for m in model]
    use_fp32_products(model, kernels)
    tiled, odd = model
    assert tiled.packed is not None and tiled.packed.kernels is kernels
    assert tiled.packed.takes_all_rows and tiled.shadow is None and tiled.weight.numel() == 0
    assert odd.packed is None and odd.shadow is not None
    for rows in (1, 5, 17, 600):
        for module, (weight, bias) in zip(model, plain, strict=True):
            x = torch.randn(rows, weight.shape[1], generator=gen).bfloat16()
            want = F.linear(x.float(), weight.float(),
                            None if bias is None else bias.float())
            got = module(x)
            assert got.dtype == torch.bfloat16
            assert ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-3).all()


# ---- prefill attention on AMX tiles against torch's SDPA ----

def _prefill_kernels() -> native.NativeKernels:
    kernels = _build("native")
    if not kernels.runs_prefill(torch.bfloat16, 8, 4, 64):
        pytest.skip("no AMX tile units and AVX512-BF16 here")
    return kernels


def _prefill_case(starts: list[int], news: list[int], heads: int, kv_heads: int, dim: int,
                  page: int = 16, seed: int = 0):
    """A pool of scattered pages holding each request's prefix and new tokens, and the
    requests' queries one after another, as the torch backend hands them over."""
    gen = torch.Generator().manual_seed(seed)
    ends = [s + n for s, n in zip(starts, news)]
    counts = [-(-e // page) for e in ends]
    ids = torch.randperm(sum(counts) + 3, generator=gen)
    size = (len(ids) * page, kv_heads, dim)
    k = torch.randn(size, generator=gen).bfloat16()
    v = torch.randn(size, generator=gen).bfloat16()
    slots, at = [], 0
    for end, count in zip(ends, counts):
        pages = ids[at:at + count]
        at += count
        slots.append((pages[:, None] * page + torch.arange(page)).flatten()[:end])
    q = torch.randn(sum(news), heads, dim, generator=gen).bfloat16()
    index = (torch.cat(slots), torch.tensor([0, *ends[:-1]]).cumsum(0),
             torch.tensor([0, *news[:-1]]).cumsum(0), torch.tensor(starts), torch.tensor(news))
    return q, k, v, slots, index


def _sdpa_prefill(q, k, v, slots, starts, news, scale, dtype):
    outs, lo = [], 0
    for sl, start, n in zip(slots, starts, news):
        qr = q[lo:lo + n].transpose(0, 1)[None].to(dtype)
        lo += n
        kr, vr = (t[sl].transpose(0, 1)[None].to(dtype) for t in (k, v))
        mask = torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
        outs.append(F.scaled_dot_product_attention(
            qr, kr, vr, attn_mask=mask, scale=scale, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 128), (4, 4, 32)])
@pytest.mark.parametrize("page", [16, 8])
def test_prefill_attention_is_as_close_to_float32_as_torchs_bf16_sdpa(
        heads: int, kv_heads: int, dim: int, page: int) -> None:
    """Prompts with nothing cached and with cached prefixes, of lengths around the 16- and
    32-key blocks, over pages of 16 (keys read in place) and of 8 (copied first): against
    float32 SDPA, no further off than torch's bf16 SDPA, which rounds the same way (bf16
    probabilities, float32 sums)."""
    kernels = _prefill_kernels()
    starts, news = [0, 5, 40, 0, 16, 0], [70, 3, 100, 1, 17, 300]
    q, k, v, slots, index = _prefill_case(starts, news, heads, kv_heads, dim, page)
    scale = dim**-0.5
    out = kernels.prefill_attention(q, k, v, *index, scale)
    exact = _sdpa_prefill(q, k, v, slots, starts, news, scale, torch.float32)
    torch_bf16 = _sdpa_prefill(q, k, v, slots, starts, news, scale, torch.bfloat16).float()
    ours, theirs = (out.float() - exact).abs(), (torch_bf16 - exact).abs()
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert ours.max() <= 1.25 * theirs.max() and ours.mean() <= 1.05 * theirs.mean()


def test_prefill_attention_of_a_request_does_not_depend_on_the_batch() -> None:
    kernels = _prefill_kernels()
    starts, news = [0, 21, 7], [45, 30, 1]
    q, k, v, slots, (flat, slot_at, q_at, st, nw) = _prefill_case(starts, news, 8, 4, 64)
    together = kernels.prefill_attention(q, k, v, flat, slot_at, q_at, st, nw, 0.125)
    alone = kernels.prefill_attention(
        q[45:75], k, v, slots[1], torch.tensor([0]), torch.tensor([0]), torch.tensor([21]),
        torch.tensor([30]), 0.125)
    assert torch.equal(alone, together[45:75])
