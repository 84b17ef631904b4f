"""Triton kernels for the gaps torch.compile cannot close in one kernel.

``qk_norm_rope_store``: inductor turns the split of the fused qkv product, Qwen3's q and k
norms, rotary and the K/V cache writes into three kernels (q and k have different head
counts, so their norms are two reductions, and V's store a third kernel). In a decode step
of a small model every kernel is short, and each costs a launch and a ramp: this does all
of it in one, one program per (token, head).

Used on CUDA when Triton is importable (``LayerOps`` picks it); the reference is
``asyncinfer.layers.fused.qk_norm_rope_store``, which it matches to a rounding (it keeps
float32 between the norm's scale and the rotation, as inductor does).
"""

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
    """Whether the Triton kernels can run on ``device`` (``ASYNCINFER_TRITON_OPS=0`` turns
    them off, to measure against torch.compile's kernels)."""
    if os.environ.get("ASYNCINFER_TRITON_OPS") == "0":
        return False
    return triton is not None and (device.type == "cuda"
                                   or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _qk_norm_rope_store_kernel(  # type: ignore[no-untyped-def]
            qkv, qkv_stride, cos, sin, rope_stride, q_weight, k_weight, q_out, k_out,
            k_cache, v_cache, k_cache_stride, v_cache_stride, slots, eps,
            HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
            NORM: tl.constexpr) -> None:
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        dim = 2 * HALF
        lo = tl.arange(0, HALF)
        hi = lo + HALF
        row = qkv + token * qkv_stride + head * dim
        x1 = tl.load(row + lo).to(tl.float32)
        x2 = tl.load(row + hi).to(tl.float32)
        slot = tl.load(slots + token).to(tl.int64)
        if head < HEADS + KV_HEADS:  # q or k: norm (Qwen3), rotate, store
            if NORM:
                scale = tl.math.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / dim + eps)
                if head < HEADS:
                    w1 = tl.load(q_weight + lo).to(tl.float32)
                    w2 = tl.load(q_weight + hi).to(tl.float32)
                else:
                    w1 = tl.load(k_weight + lo).to(tl.float32)
                    w2 = tl.load(k_weight + hi).to(tl.float32)
                # The norm's output is a tensor of the activations' dtype in the reference.
                x1 = (x1 * scale * w1).to(q_out.dtype.element_ty).to(tl.float32)
                x2 = (x2 * scale * w2).to(q_out.dtype.element_ty).to(tl.float32)
            c1 = tl.load(cos + token * rope_stride + lo).to(tl.float32)
            c2 = tl.load(cos + token * rope_stride + hi).to(tl.float32)
            s1 = tl.load(sin + token * rope_stride + lo).to(tl.float32)
            s2 = tl.load(sin + token * rope_stride + hi).to(tl.float32)
            o1 = x1 * c1 - x2 * s1
            o2 = x2 * c2 + x1 * s2
            if head < HEADS:
                dst = q_out + (token * HEADS + head) * dim
                tl.store(dst + lo, o1.to(q_out.dtype.element_ty))
                tl.store(dst + hi, o2.to(q_out.dtype.element_ty))
            else:
                kv_head = head - HEADS
                dst = k_out + (token * KV_HEADS + kv_head) * dim
                tl.store(dst + lo, o1.to(k_out.dtype.element_ty))
                tl.store(dst + hi, o2.to(k_out.dtype.element_ty))
                dst = k_cache + slot * k_cache_stride + kv_head * dim
                tl.store(dst + lo, o1.to(k_cache.dtype.element_ty))
                tl.store(dst + hi, o2.to(k_cache.dtype.element_ty))
        else:  # v: stored as it is
            dst = v_cache + slot * v_cache_stride + (head - HEADS - KV_HEADS) * dim
            tl.store(dst + lo, x1.to(v_cache.dtype.element_ty))
            tl.store(dst + hi, x2.to(v_cache.dtype.element_ty))


def qk_norm_rope_store(qkv: Tensor, cos: Tensor, sin: Tensor, q_weight: Tensor | None,
                       k_weight: Tensor | None, eps: float, heads: int, kv_heads: int,
                       head_dim: int, k_cache: Tensor, v_cache: Tensor,
                       slots: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``layers.fused.qk_norm_rope_store`` in one Triton kernel (same arguments, same
    results): q [T, heads, dim] and k [T, kv_heads, dim] normed and rotated, v a view of
    ``qkv``; k and v written to their ``slots`` of the caches."""
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
        kernel[(tokens, heads + 2 * kv_heads)](
            qkv, qkv.stride(0), cos2, sin2, cos2.stride(0),
            q_weight if norm else q, k_weight if norm else k, q, k, k_cache, v_cache,
            k_cache.stride(0), v_cache.stride(0), slots, eps, HEADS=heads,
            KV_HEADS=kv_heads, HALF=head_dim // 2, NORM=norm, num_warps=1)
    return q, k, v
