"""Triton kernels for the gaps torch.compile cannot close in one kernel: ``qk_norm_rope_store``
(reference: layers.fused) and the sampler's ``race``. See docs/architecture.md, 'Triton ops'."""

from __future__ import annotations

import os
from typing import Any

import torch

from asyncinfer.kvcache.pool import FP8_DTYPES

Tensor = torch.Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None


def available(device: torch.device, op: str = "") -> bool:
    """Whether the Triton kernels run on ``device`` (CUDA, or ``TRITON_INTERPRET=1``); ``op``
    names the caller's kernel ("race", "rope")."""
    del op
    return triton is not None and (device.type == "cuda"
                                   or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _rope_heads(row, count, weight, c1, c2, s1, s2, eps,  # type: ignore[no-untyped-def]
                    PADDED: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr,
                    ROUND_TO: tl.constexpr):
        # ``count`` heads of one token from ``row``: normed (Qwen3) and rotated, in float32.
        head = tl.arange(0, PADDED)[:, None]
        lo = tl.arange(0, HALF)[None, :]
        live = head < count
        x1 = tl.load(row + head * (2 * HALF) + lo, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(row + head * (2 * HALF) + HALF + lo, mask=live,
                     other=0.0).to(tl.float32)
        if NORM:
            scale = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
            w1 = tl.load(weight + lo).to(tl.float32)
            w2 = tl.load(weight + HALF + lo).to(tl.float32)
            # The norm's output is a tensor of the activations' dtype in the reference.
            x1 = (x1 * scale[:, None] * w1).to(ROUND_TO).to(tl.float32)
            x2 = (x2 * scale[:, None] * w2).to(ROUND_TO).to(tl.float32)
        return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2

    @triton.jit
    def _qk_norm_rope_store_kernel(  # type: ignore[no-untyped-def]
            qkv, qkv_stride, cos, sin, rope_stride, q_weight, k_weight, q_out, k_out,
            k_cache, v_cache, k_cache_stride, v_cache_stride, slots, eps,
            HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
            GROUP: tl.constexpr, Q_GROUPS: tl.constexpr, KV_GROUPS: tl.constexpr,
            NORM: tl.constexpr, KV_MAX: tl.constexpr) -> None:
        # KV_MAX > 0: an FP8 cache, whose values saturate at +-KV_MAX.
        # Program (token, g): q's heads [g * GROUP, ...) for g < Q_GROUPS, then k's groups
        # (rotated, and written to the cache too), then v's (written to the cache).
        token = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1)
        dim = 2 * HALF
        lo = tl.arange(0, HALF)[None, :]
        head = tl.arange(0, GROUP)[:, None]
        row = qkv + token * qkv_stride
        slot = tl.load(slots + token).to(tl.int64)
        dtype = q_out.dtype.element_ty
        if group < Q_GROUPS + KV_GROUPS:
            c1 = tl.load(cos + token * rope_stride + lo).to(tl.float32)
            c2 = tl.load(cos + token * rope_stride + HALF + lo).to(tl.float32)
            s1 = tl.load(sin + token * rope_stride + lo).to(tl.float32)
            s2 = tl.load(sin + token * rope_stride + HALF + lo).to(tl.float32)
            if group < Q_GROUPS:
                first = group * GROUP
                o1, o2 = _rope_heads(row + first * dim, HEADS - first, q_weight, c1, c2, s1,
                                     s2, eps, GROUP, HALF, NORM, dtype)
                live = head < HEADS - first
                dst = q_out + (token * HEADS + first) * dim + head * dim + lo
                tl.store(dst, o1.to(dtype), mask=live)
                tl.store(dst + HALF, o2.to(dtype), mask=live)
            else:
                first = (group - Q_GROUPS) * GROUP
                o1, o2 = _rope_heads(row + (HEADS + first) * dim, KV_HEADS - first, k_weight,
                                     c1, c2, s1, s2, eps, GROUP, HALF, NORM, dtype)
                live = head < KV_HEADS - first
                dst = k_out + (token * KV_HEADS + first) * dim + head * dim + lo
                tl.store(dst, o1.to(dtype), mask=live)
                tl.store(dst + HALF, o2.to(dtype), mask=live)
                # Its own name: Triton wants one type per name across branches, and the
                # cache's element type may differ from the activations' (FP8).
                k_dst = k_cache + slot * k_cache_stride + (first + head) * dim + lo
                if KV_MAX > 0:
                    o1 = tl.minimum(tl.maximum(o1, -KV_MAX), KV_MAX)
                    o2 = tl.minimum(tl.maximum(o2, -KV_MAX), KV_MAX)
                tl.store(k_dst, o1.to(k_cache.dtype.element_ty), mask=live)
                tl.store(k_dst + HALF, o2.to(k_cache.dtype.element_ty), mask=live)
        else:  # v: stored as it is
            first = (group - Q_GROUPS - KV_GROUPS) * GROUP
            live = head < KV_HEADS - first
            src = row + (HEADS + KV_HEADS + first + head) * dim + lo
            v_dst = v_cache + slot * v_cache_stride + (first + head) * dim + lo
            v1 = tl.load(src, mask=live).to(tl.float32)
            v2 = tl.load(src + HALF, mask=live).to(tl.float32)
            if KV_MAX > 0:
                v1 = tl.minimum(tl.maximum(v1, -KV_MAX), KV_MAX)
                v2 = tl.minimum(tl.maximum(v2, -KV_MAX), KV_MAX)
            tl.store(v_dst, v1.to(v_cache.dtype.element_ty), mask=live)
            tl.store(v_dst + HALF, v2.to(v_cache.dtype.element_ty), mask=live)

    @triton.jit
    def _hash32(x):
        # engine.sampler._hash32 on uint32: multiplies wrap modulo 2**32 natively.
        x = x ^ (x >> 16)
        x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
        x = x ^ (x >> 15)
        x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
        return x ^ (x >> 16)

    @triton.jit
    def _race_chunks_kernel(  # type: ignore[no-untyped-def]
            logits, logits_stride, inv_temperature, keys, best_value, best_index, vocab,
            CHUNKS: tl.constexpr, BLOCK: tl.constexpr) -> None:
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        inside = cols < vocab
        x = tl.load(logits + row * logits_stride + cols, mask=inside,
                    other=0.0).to(tl.float32)
        inv_t = tl.load(inv_temperature + row)
        key = tl.load(keys + row)
        lo = (key & 0xFFFFFFFF).to(tl.uint32)
        hi = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
        bits = _hash32(_hash32(cols.to(tl.uint32) + lo) ^ hi)
        uniform = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / (1 << 23))
        noisy = x * inv_t - tl.log(-tl.log(uniform))
        score = tl.where(inv_t == 0, x, noisy)
        score = tl.where(inside, score, float("-inf"))
        value, index = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(best_value + row * CHUNKS + chunk, value)
        tl.store(best_index + row * CHUNKS + chunk, index + chunk * BLOCK)

    @triton.jit
    def _race_rows_kernel(best_value, best_index, tokens,  # type: ignore[no-untyped-def]
                          CHUNKS: tl.constexpr, PADDED: tl.constexpr) -> None:
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, PADDED)
        value = tl.load(best_value + row * CHUNKS + i, mask=i < CHUNKS, other=float("-inf"))
        _, chunk = tl.max(value, 0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(tokens + row, tl.load(best_index + row * CHUNKS + chunk).to(tl.int64))


RACE_BLOCK = 4096


def race(logits: Tensor, inv_temperature: Tensor, keys: Tensor) -> Tensor:
    """``engine.sampler.race`` in two Triton kernels (same tokens up to ``log``'s rounding)."""
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return tokens
    assert logits.stride(1) == 1
    chunks = triton.cdiv(vocab, RACE_BLOCK)
    value = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    index = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    first: Any = _race_chunks_kernel
    first[(rows, chunks)](logits, logits.stride(0), inv_temperature, keys, value, index, vocab,
                          CHUNKS=chunks, BLOCK=RACE_BLOCK, num_warps=8)
    second: Any = _race_rows_kernel
    second[(rows,)](value, index, tokens, CHUNKS=chunks,
                    PADDED=max(16, triton.next_power_of_2(chunks)), num_warps=1)
    return tokens


def rope_group(tokens: int) -> tuple[int, int]:
    """Heads per program and warps for ``tokens`` tokens (measured: docs/benchmarks.md)."""
    if tokens < 16:
        return 1, 1
    if tokens < 128:
        return 4, 2
    return 8, 4


def qk_norm_rope_store(qkv: Tensor, cos: Tensor, sin: Tensor, q_weight: Tensor | None,
                       k_weight: Tensor | None, eps: float, heads: int, kv_heads: int,
                       head_dim: int, k_cache: Tensor, v_cache: Tensor,
                       slots: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``layers.fused.qk_norm_rope_store`` in one Triton kernel (same arguments and results)."""
    tokens = qkv.shape[0]
    assert qkv.stride(-1) == 1 and head_dim % 2 == 0 and (head_dim & (head_dim - 1)) == 0
    assert k_cache.stride(1) == v_cache.stride(1) == head_dim, "caches [slots, heads, dim]"
    q = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(tokens, kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    if tokens:
        norm = q_weight is not None and k_weight is not None
        cos2, sin2 = cos.reshape(tokens, head_dim), sin.reshape(tokens, head_dim)
        assert cos2.stride() == sin2.stride() and cos2.stride(1) == 1
        kernel: Any = _qk_norm_rope_store_kernel
        group, warps = rope_group(tokens)
        q_groups, kv_groups = triton.cdiv(heads, group), triton.cdiv(kv_heads, group)
        kernel[(tokens, q_groups + 2 * kv_groups)](
            qkv, qkv.stride(0), cos2, sin2, cos2.stride(0),
            q_weight if norm else q, k_weight if norm else k, q, k, k_cache, v_cache,
            k_cache.stride(0), v_cache.stride(0), slots, eps, HEADS=heads,
            KV_HEADS=kv_heads, HALF=head_dim // 2, GROUP=group, Q_GROUPS=q_groups,
            KV_GROUPS=kv_groups, NORM=norm, KV_MAX=FP8_DTYPES.get(k_cache.dtype, 0.0),
            num_warps=warps)
    return q, k, v
