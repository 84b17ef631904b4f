"""Checks of the batch-invariant mode's Triton kernels and of the engine run through them,
meant for a process with ``TRITON_INTERPRET=1`` set before triton loads (on the CPU):
``python -m tests.triton_invariant_checks kernels`` or ``... engine MODEL_DIR``. Each prints
what it checked and exits non-zero on the first failure (tests/test_batch_invariant_triton.py
runs them)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.nn import functional as F


def _fixed_order_dots() -> None:
    """Make the interpreter's ``tl.dot`` reduce each output in one order along K whatever the
    row's place in its tile. It multiplies tiles with numpy's matmul, whose BLAS (OpenBLAS on
    an AVX2 host) orders a row's sums by where the row sits in the tile; a GPU's MMA does
    not, and the kernel's blocking is what these checks are about. numpy's einsum, without
    BLAS, sums each output along K alike."""
    import numpy as np
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        del self, input_precision, max_num_imprecise_acc
        product = np.einsum("...ik,...kj->...ij", a.data.astype(d.data.dtype),
                            b.data.astype(d.data.dtype), optimize=False)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    """Within ``tol`` relative to each value (at least to 1). Triton's interpreter rounds
    to bf16 by cutting bits, so bf16 results may sit an ulp below torch's."""
    return bool(((got.float() - want.float()).abs() / want.float().abs().clamp(min=1)).max()
                < tol)


def check_products() -> None:
    """x Wᵀ + b against torch's within rounding; each row bit for bit the same whatever the
    rows beside it, their number (1 to past one tile) and its place among them."""
    from asyncinfer.kernels import triton_invariant as ti

    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        x = torch.randn(150, 72).to(dtype)
        w = torch.randn(90, 72).to(dtype)
        b = torch.randn(90).to(dtype)
        whole = ti.linear(x, w, b)
        assert _close(whole, F.linear(x.float(), w.float(), b.float()), tol)
        for lo, hi in ((0, 1), (7, 8), (3, 70), (64, 150), (149, 150)):
            assert torch.equal(ti.linear(x[lo:hi], w, b), whole[lo:hi]), (dtype, lo, hi)
        shuffled = torch.randperm(150)
        assert torch.equal(ti.linear(x[shuffled], w, b), whole[shuffled])
        assert torch.equal(ti.linear(x, w), ti.linear(x, w, None))
    print("products: ok")


def check_norms() -> None:
    """RMSNorm (plain and Gemma's offset), with and without the residual add, against
    layers.fused's torch ops; rows bit for bit the same alone as in a batch."""
    from asyncinfer.kernels import triton_invariant as ti
    from asyncinfer.layers import fused

    torch.manual_seed(1)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = torch.randn(33, 80).to(dtype)
        r = torch.randn(33, 80).to(dtype)
        w = (1 + 0.1 * torch.randn(80)).to(dtype)
        for ours, theirs in ((ti.rms_norm, fused.rms_norm),
                             (ti.offset_rms_norm, fused.offset_rms_norm)):
            got = ours(x, w, 1e-6)
            assert _close(got, theirs(x, w, 1e-6), tol)
            assert torch.equal(ours(x[5:6], w, 1e-6), got[5:6])
        for ours, theirs in ((ti.add_rms_norm, fused.add_rms_norm),
                             (ti.add_offset_rms_norm, fused.add_offset_rms_norm)):
            got, summed = ours(x, r, w, 1e-6)
            want, want_summed = theirs(x, r, w, 1e-6)
            assert _close(summed, want_summed, tol)
            assert _close(got, want, tol)
            alone, _ = ours(x[9:11], r[9:11], w, 1e-6)
            assert torch.equal(alone, got[9:11])
    print("norms: ok")


def _reference_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         slots: torch.Tensor, scale: float) -> torch.Tensor:
    group = q.shape[0] // k_pool.shape[1]
    k = k_pool[slots].float().repeat_interleave(group, 1)
    v = v_pool[slots].float().repeat_interleave(group, 1)
    weights = (torch.einsum("hd,khd->hk", q.float(), k) * scale).softmax(-1)
    return torch.einsum("hk,khd->hd", weights, v)


def check_attention() -> None:
    """Each query against its own keys (GQA, a window or none) as a float64-free reference
    computes it; a query's output bit for bit the same alone, beside others, inside a prefill
    chunk of any split, and with its keys' slots elsewhere in the pool (a cache hit's
    pages are other pages than a recompute's)."""
    from asyncinfer.kernels import triton_invariant as ti

    torch.manual_seed(2)
    heads, kv_heads, dim, slots = 4, 2, 16, 300
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        k_pool = torch.randn(slots, kv_heads, dim).to(dtype)
        v_pool = torch.randn(slots, kv_heads, dim).to(dtype)
        order = torch.randperm(slots)
        table = torch.stack([order[:100], order[100:200]]).contiguous()
        q = torch.randn(70, heads, dim).to(dtype)
        # Request 0's prompt positions 0..69 as one chunk of queries.
        rows = torch.zeros(70, dtype=torch.int64)
        lens = torch.arange(1, 71)
        for window in (None, 20):
            whole = ti.decode_attention(q, k_pool, v_pool, table, rows, lens, 0.25, 70,
                                        window)
            for i in (0, 1, 31, 32, 33, 69):
                lo = 0 if window is None else max(0, i + 1 - window)
                want = _reference_attention(q[i], k_pool, v_pool, table[0, lo:i + 1], 0.25)
                assert _close(whole[i], want, tol), (dtype, window, i)
            for lo, hi in ((0, 17), (17, 64), (64, 70), (69, 70)):  # other chunkings
                part = ti.decode_attention(q[lo:hi], k_pool, v_pool, table, rows[lo:hi],
                                           lens[lo:hi], 0.25, 70, window)
                assert torch.equal(part, whole[lo:hi]), (dtype, window, lo, hi)
            # Beside another request's queries, in row 1 of the table.
            mixed = ti.decode_attention(
                torch.cat([q[40:41], q[3:5]]), k_pool, v_pool, table,
                torch.tensor([0, 1, 1]), torch.tensor([41, 90, 91]), 0.25, 91, window)
            assert torch.equal(mixed[:1], whole[40:41])
            # The same keys and values held in other slots.
            moved_k, moved_v = torch.empty_like(k_pool), torch.empty_like(v_pool)
            elsewhere = torch.stack([order[200:300], order[:100]]).contiguous()
            moved_k[elsewhere[0]] = k_pool[table[0]]
            moved_v[elsewhere[0]] = v_pool[table[0]]
            moved = ti.decode_attention(q, moved_k, moved_v, elsewhere, rows, lens, 0.25, 70,
                                        window)
            assert torch.equal(moved, whole)
    print("attention: ok")


def check_softmax() -> None:
    """Row log-softmax and softmax (with a temperature per row, rows of -inf chunks among
    them) against torch's; each row bit for bit the same alone."""
    from asyncinfer.kernels import triton_invariant as ti

    torch.manual_seed(3)
    logits = torch.randn(5, 5000) * 4
    logits[1, :4500] = float("-inf")       # masked tokens, whole chunks of them
    inv_t = torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0])
    got = ti.log_softmax(logits)
    want = torch.log_softmax(logits, -1)
    finite = want.isfinite()
    assert torch.equal(finite, got.isfinite())
    assert (got[finite] - want[finite]).abs().max() < 1e-5
    probs = ti.softmax(logits, inv_t)
    assert (probs - torch.softmax(logits * inv_t[:, None], -1)).abs().max() < 1e-6
    assert torch.equal(ti.log_softmax(logits[2:3]), got[2:3])
    assert torch.equal(ti.softmax(logits[1:2], inv_t[1:2]), probs[1:2])
    assert torch.equal(ti.log_softmax(logits.bfloat16())[0],
                       ti.log_softmax(logits.bfloat16()[:1])[0])
    print("softmax: ok")


def check_engine(model_dir: Path) -> None:
    """The engine with the mode's CUDA path (its Triton kernels, torch between them), on the
    CPU: float32 greedy tokens equal transformers'; in bf16, one request's tokens and
    logprobs bit for bit the same alone, beside others, in chunks and after a cache hit,
    greedy and seeded at temperature 1 (top-p too)."""
    from asyncinfer.api import LLM
    from asyncinfer.engine import invariant, runner
    from asyncinfer.kernels import triton_invariant
    from asyncinfer.params import SamplingParams
    from tests.hf_reference import hf_greedy, load_hf

    def on_cuda(device: torch.device) -> bool:
        return True  # as on CUDA

    invariant.triton_invariant_path = runner.triton_invariant_path = on_cuda

    def engine(dtype: str, **options: object) -> LLM:
        return LLM(str(model_dir), skip_tokenizer_init=True, dtype=dtype, cpu_kernels=False,
                   batch_invariant=True, max_running_requests=4, max_seq_len=128,
                   num_pages=48, page_size=8, **options)  # type: ignore[arg-type]

    prompts = [[3 + (7 * i) % 200 for i in range(21)], [5, 9, 11, 4], [17] * 12]
    exact = engine("float32", cache_type="naive")
    try:
        runner = exact.engine.runner
        assert runner.batch_invariant
        assert runner.model.lm_head.product is triton_invariant.linear
        assert runner.backend.decoder.decode_attention is triton_invariant.decode_attention
        hf = load_hf(model_dir)
        got = exact.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0,
                                                     ignore_eos=True), use_tqdm=False)
        for prompt, out in zip(prompts, got):
            assert out.token_ids == hf_greedy(hf, prompt, 5), (prompt, out.token_ids)
    finally:
        exact.close()
    print("engine float32 = transformers: ok")

    reference = engine("bfloat16", cache_type="naive")
    radix = engine("bfloat16")
    chunked = engine("bfloat16", max_extend_tokens=8)
    cases = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2),
             SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9, seed=7,
                            ignore_eos=True, logprobs=2)]
    try:
        for params in cases:
            alone = reference.generate([prompts[0]], params, use_tqdm=False)[0]
            seen = {"alone": alone,
                    "batched": reference.generate(prompts, params, use_tqdm=False)[0],
                    "chunked": chunked.generate(prompts[::-1], params, use_tqdm=False)[-1],
                    "miss": radix.generate([prompts[0]], params, use_tqdm=False)[0],
                    "hit": radix.generate([[*prompts[0][:17], 1, 2, 3], prompts[0]], params,
                                          use_tqdm=False)[1]}
            assert seen["hit"].cached_tokens > 0
            for name, out in seen.items():
                assert out.token_ids == alone.token_ids, (name, params, out.token_ids,
                                                          alone.token_ids)
                assert ([x.logprob for x in out.logprobs]
                        == [x.logprob for x in alone.logprobs]), (name, params)
    finally:
        for llm in (reference, radix, chunked):
            llm.close()
    print("engine bf16 invariant: ok")


if __name__ == "__main__":
    _fixed_order_dots()
    if sys.argv[1] == "kernels":
        check_products()
        check_norms()
        check_attention()
        check_softmax()
    else:
        check_engine(Path(sys.argv[2]))
