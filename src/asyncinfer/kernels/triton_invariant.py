"""Triton kernels of the batch-invariant mode on CUDA: a matrix product, RMSNorm, paged
attention and the sampler's row softmax, each summing a row in one order that no other row,
no batch size and no chunk boundary changes. See docs/architecture.md, 'Batch-invariant
mode'.

Each kernel has one launch configuration (tile sizes, warps), whatever the shapes: a row's
sums then run over the same blocks in the same order, and a tile's other rows (or its
padding) never enter them. cuBLAS and flashinfer pick split-K, split-KV or a tile size by
the problem's size, which is what makes their results follow the batch."""

from __future__ import annotations

import os
from typing import Any

import torch

Tensor = torch.Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None


def available(device: torch.device) -> bool:
    """Whether these kernels run on ``device`` (CUDA, or ``TRITON_INTERPRET=1``)."""
    return triton is not None and (device.type == "cuda"
                                   or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _matmul_kernel(x, w, bias, out, rows, cols, depth,  # type: ignore[no-untyped-def]
                       x_stride, w_stride, out_stride, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PRECISION: tl.constexpr, UPCAST: tl.constexpr) -> None:
        # out[m, n] = sum over k of x[m, k] w[n, k]: float32 sums along k in BLOCK_K steps,
        # from k = 0 up, whatever ``rows`` is (no split along k).
        m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, depth, BLOCK_K):
            kk = k0 + k
            a = tl.load(x + m[:, None] * x_stride + kk[None, :],
                        mask=(m[:, None] < rows) & (kk[None, :] < depth), other=0.0)
            b = tl.load(w + n[None, :] * w_stride + kk[:, None],
                        mask=(n[None, :] < cols) & (kk[:, None] < depth), other=0.0)
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias + n, mask=n < cols, other=0.0).to(tl.float32)[None, :]
        tl.store(out + m[:, None] * out_stride + n[None, :], acc.to(out.dtype.element_ty),
                 mask=(m[:, None] < rows) & (n[None, :] < cols))

    @triton.jit
    def _rms_norm_kernel(x, x_stride, residual, residual_stride,  # type: ignore[no-untyped-def]
                         weight, out, out_stride, summed, summed_stride, width, eps,
                         ADD: tl.constexpr, OFFSET: tl.constexpr,
                         BLOCK: tl.constexpr) -> None:
        # One row per program, the whole row in one block: one tree of sums per width.
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)
        live = i < width
        h = tl.load(x + row * x_stride + i, mask=live, other=0.0)
        dtype = out.dtype.element_ty
        if ADD:  # the residual stream, rounded to its dtype as the reference adds it
            h = (h.to(tl.float32) + tl.load(residual + row * residual_stride + i, mask=live,
                                            other=0.0).to(tl.float32)).to(dtype)
            tl.store(summed + row * summed_stride + i, h, mask=live)
        f = h.to(tl.float32)
        scale = tl.math.rsqrt(tl.sum(f * f, 0) / width + eps)
        w = tl.load(weight + i, mask=live, other=0.0).to(tl.float32)
        if OFFSET:  # noqa: SIM108 - a compile-time branch. Gemma: (1 + w) x / rms(x)
            y = f * scale * (1.0 + w)
        else:       # w * (x / rms(x) rounded to the dtype)
            y = w * (f * scale).to(dtype).to(tl.float32)
        tl.store(out + row * out_stride + i, y.to(dtype), mask=live)

    @triton.jit
    def _attention_kernel(q, q_stride, k_pool, v_pool, pool_stride,  # type: ignore[no-untyped-def]
                          table, table_stride, rows, lens, out, out_stride, scale, window,
                          GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr,
                          DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                          WINDOWED: tl.constexpr, PRECISION: tl.constexpr,
                          UPCAST: tl.constexpr) -> None:
        # Program (query, kv head): the query's GROUP heads against keys 0 .. lens - 1 of its
        # row of ``table``, in blocks of BLOCK_N keys that start at multiples of BLOCK_N from
        # position 0: the same blocks for a query whether it decodes, sits in a prefill chunk
        # or follows a cached prefix. Online softmax, float32.
        query = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        row = tl.load(rows + query)
        length = tl.load(lens + query)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM_PAD)
        head_dim = d[None, :] < DIM
        heads = kv_head * GROUP + g
        q_at = q + query * q_stride + heads[:, None] * DIM + d[None, :]
        qb = tl.load(q_at, mask=(g[:, None] < GROUP) & head_dim, other=0.0)
        if UPCAST:
            qb = qb.to(tl.float32)
        first = 0
        if WINDOWED:
            first = tl.maximum(length - window, 0)
        best = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
        total = tl.zeros((GROUP_PAD,), dtype=tl.float32)
        acc = tl.zeros((GROUP_PAD, DIM_PAD), dtype=tl.float32)
        for start in range((first // BLOCK_N) * BLOCK_N, length, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            seen = (j < length) & (j >= first)
            slot = tl.load(table + row * table_stride + j, mask=seen, other=0)
            at = slot[:, None] * pool_stride + kv_head * DIM + d[None, :]
            kb = tl.load(k_pool + at, mask=seen[:, None] & head_dim, other=0.0)
            vb = tl.load(v_pool + at, mask=seen[:, None] & head_dim, other=0.0)
            if UPCAST:
                kb, vb = kb.to(tl.float32), vb.to(tl.float32)
            s = tl.dot(qb, tl.trans(kb), input_precision=PRECISION) * scale
            s = tl.where(seen[None, :], s, float("-inf"))
            new_best = tl.maximum(best, tl.max(s, 1))
            alpha = tl.exp(best - new_best)
            p = tl.exp(s - new_best[:, None])
            total = total * alpha + tl.sum(p, 1)
            if UPCAST:  # the rounding of p that the GPU's half-precision product does
                p = p.to(v_pool.dtype.element_ty).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=PRECISION)
            best = new_best
        o = acc / total[:, None]
        out_at = out + query * out_stride + heads[:, None] * DIM + d[None, :]
        tl.store(out_at, o.to(out.dtype.element_ty), mask=(g[:, None] < GROUP) & head_dim)

    @triton.jit
    def _softmax_kernel(x, x_stride, inv_temperature, out,  # type: ignore[no-untyped-def]
                        out_stride, width, LOG: tl.constexpr, SCALED: tl.constexpr,
                        BLOCK: tl.constexpr) -> None:
        # One row per program, in BLOCK-wide chunks from column 0: a running maximum and sum,
        # then the row written.
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)
        inv_t = 1.0
        if SCALED:
            inv_t = tl.load(inv_temperature + row)
        # A finite floor: a chunk of -inf (masked tokens) then leaves best and total as
        # they are, with no -inf - -inf on the way.
        best = tl.full((), -3.0e38, dtype=tl.float32)
        total = tl.zeros((), dtype=tl.float32)
        for start in range(0, width, BLOCK):
            cols = start + i
            v = tl.load(x + row * x_stride + cols, mask=cols < width,
                        other=float("-inf")).to(tl.float32) * inv_t
            new_best = tl.maximum(best, tl.max(v, 0))
            total = total * tl.exp(best - new_best) + tl.sum(tl.exp(v - new_best), 0)
            best = new_best
        log_total = tl.log(total)
        for start in range(0, width, BLOCK):
            cols = start + i
            v = tl.load(x + row * x_stride + cols, mask=cols < width,
                        other=float("-inf")).to(tl.float32) * inv_t
            if LOG:  # noqa: SIM108 - a compile-time branch
                y = v - best - log_total
            else:
                y = tl.exp(v - best) / total
            tl.store(out + row * out_stride + cols, y, mask=cols < width)


BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
"""The product's one tile: every call, every size."""

KEY_BLOCK = 32
"""Keys per step of the attention: every query, every phase."""

SOFTMAX_BLOCK = 2048
"""Columns per step of the row softmax."""


def _precision(dtype: torch.dtype) -> str:
    # float32 stays float32 (no TF32 rounding of the inputs).
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    # Triton's interpreter multiplies half-precision tiles wrong: there, the tiles go in as
    # float32, which is what the GPU's products compute (exact products, float32 sums).
    return dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1"


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x Wᵀ + b`` for x [..., in] and W [out, in], each output row summed along ``in`` in
    one fixed order whatever the number of rows."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    rows, depth = flat.shape
    cols = weight.shape[0]
    out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    if rows:
        kernel: Any = _matmul_kernel
        grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(cols, BLOCK_N))
        kernel[grid](flat, weight, weight if bias is None else bias, out, rows, cols, depth,
                     flat.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                     BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                     PRECISION=_precision(x.dtype), UPCAST=_upcast(x.dtype), num_warps=4,
                     num_stages=2)
    return out.view(*x.shape[:-1], cols)


def _norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float,
          offset: bool) -> tuple[Tensor, Tensor | None]:
    width = x.shape[-1]
    flat = x.reshape(-1, width)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty_like(flat)
    summed = None
    res = flat
    if residual is not None:
        res = residual.reshape(-1, width)
        if res.stride(-1) != 1:
            res = res.contiguous()
        summed = torch.empty_like(flat)
    if flat.shape[0]:
        kernel: Any = _rms_norm_kernel
        kernel[(flat.shape[0],)](flat, flat.stride(0), res, res.stride(0), weight, out,
                                 out.stride(0), out if summed is None else summed,
                                 out.stride(0) if summed is None else summed.stride(0),
                                 width, eps, ADD=residual is not None, OFFSET=offset,
                                 BLOCK=triton.next_power_of_2(width), num_warps=4)
    return out.view(x.shape), None if summed is None else summed.view(x.shape)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``layers.fused.rms_norm``, one fixed order of sums per row."""
    return _norm(x, None, weight, eps, offset=False)[0]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor,
                 eps: float) -> tuple[Tensor, Tensor]:
    """``layers.fused.add_rms_norm``: ``(norm(residual + x), residual + x)``."""
    out, summed = _norm(x, residual, weight, eps, offset=False)
    assert summed is not None
    return out, summed


def offset_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``layers.fused.offset_rms_norm`` (Gemma), one fixed order of sums per row."""
    return _norm(x, None, weight, eps, offset=True)[0]


def add_offset_rms_norm(x: Tensor, residual: Tensor, weight: Tensor,
                        eps: float) -> tuple[Tensor, Tensor]:
    """``layers.fused.add_offset_rms_norm``, one fixed order of sums per row."""
    out, summed = _norm(x, residual, weight, eps, offset=True)
    assert summed is not None
    return out, summed


def decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, table: Tensor, rows: Tensor,
                     lens: Tensor, scale: float, max_len: int,
                     window: int | None = None) -> Tensor:
    """``NativeKernels.decode_attention`` on the GPU: query i [heads, dim] of q against
    keys 0 .. lens[i] - 1 of row ``rows[i]`` of ``table`` (each position's KV slot) in the
    layer's pools [slots, kv_heads, dim]; [queries, heads, dim] in q's dtype. With a
    ``window``, only each query's last ``window`` keys."""
    del max_len  # lens bound each query's own loop
    q = q.contiguous()
    queries, heads, dim = q.shape
    kv_heads = k_pool.shape[1]
    assert k_pool.is_contiguous() and v_pool.is_contiguous() and table.stride(1) == 1
    if q.dtype != k_pool.dtype:
        q = q.to(k_pool.dtype)
    out = torch.empty_like(q)
    if queries:
        group = heads // kv_heads
        kernel: Any = _attention_kernel
        kernel[(queries, kv_heads)](
            q, q.stride(0), k_pool, v_pool, k_pool.stride(0), table, table.stride(0), rows,
            lens, out, out.stride(0), scale, window or 0, GROUP=group,
            GROUP_PAD=max(16, triton.next_power_of_2(group)), DIM=dim,
            DIM_PAD=max(16, triton.next_power_of_2(dim)), BLOCK_N=KEY_BLOCK,
            WINDOWED=window is not None, PRECISION=_precision(q.dtype),
            UPCAST=_upcast(q.dtype), num_warps=4)
    return out


def _softmax(logits: Tensor, inv_temperature: Tensor | None, log: bool) -> Tensor:
    rows, width = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, width, dtype=torch.float32, device=logits.device)
    if rows:
        kernel: Any = _softmax_kernel
        kernel[(rows,)](logits, logits.stride(0),
                        logits if inv_temperature is None else inv_temperature, out,
                        out.stride(0), width, LOG=log, SCALED=inv_temperature is not None,
                        BLOCK=SOFTMAX_BLOCK, num_warps=8)
    return out


def log_softmax(logits: Tensor) -> Tensor:
    """Each row's log-softmax in float32, one fixed order of sums per row."""
    return _softmax(logits, None, log=True)


def softmax(logits: Tensor, inv_temperature: Tensor) -> Tensor:
    """Each row's softmax of ``logits * inv_temperature[row]`` in float32, one fixed order of
    sums per row."""
    return _softmax(logits, inv_temperature.to(torch.float32), log=False)
