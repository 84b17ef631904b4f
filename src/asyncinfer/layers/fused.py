"""The elementwise ops between a decoder layer's matrix products: torch references with
Triton and C implementations registered per op. See docs/architecture.md, 'Fused layer ops'."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from attrs import frozen
from torch.nn import functional as F

from asyncinfer.kernels import triton_invariant
from asyncinfer.kvcache.pool import store_kv
from asyncinfer.layers import triton_ops

if TYPE_CHECKING:
    from asyncinfer.kernels.cpu import NativeKernels

Tensor = torch.Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * x / rms(x)``: the reduction in float32, the scale in the input dtype."""
    dtype = x.dtype
    if x.is_cuda and dtype != torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor,
                 eps: float) -> tuple[Tensor, Tensor]:
    """The residual connection and the next norm: ``r = residual + x``; ``(norm(r), r)``."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def offset_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gemma's ``(1 + weight) * x / rms(x)``: reduction and scale in float32, one rounding
    to the input dtype at the end (as transformers' Gemma3RMSNorm)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.to(torch.float32))).to(x.dtype)


def add_offset_rms_norm(x: Tensor, residual: Tensor, weight: Tensor,
                        eps: float) -> tuple[Tensor, Tensor]:
    """``add_rms_norm`` with ``offset_rms_norm``."""
    residual = residual + x
    return offset_rms_norm(residual, weight, eps), residual


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def qk_norm_rope(qkv: Tensor, cos: Tensor, sin: Tensor, q_weight: Tensor | None,
                 k_weight: Tensor | None, eps: float, heads: int, kv_heads: int,
                 head_dim: int, norm: Callable[[Tensor, Tensor, float], Tensor] = rms_norm
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """Split qkv [T, (heads + 2 kv_heads) * dim] into q, k, v; RMSNorm q and k per head when
    weights are given; rotate q and k by ``cos``/``sin`` [T, 1, dim]. v is a view of qkv."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(-1, heads, head_dim)
    k = k.view(-1, kv_heads, head_dim)
    v = v.view(-1, kv_heads, head_dim)
    if q_weight is not None and k_weight is not None:
        q, k = norm(q, q_weight, eps), norm(k, k_weight, eps)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v


def qk_norm_rope_store(qkv: Tensor, cos: Tensor, sin: Tensor, q_weight: Tensor | None,
                       k_weight: Tensor | None, eps: float, heads: int, kv_heads: int,
                       head_dim: int, k_cache: Tensor, v_cache: Tensor,
                       slots: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``qk_norm_rope``, then k and v written to their ``slots`` of the layer's caches."""
    q, k, v = qk_norm_rope(qkv, cos, sin, q_weight, k_weight, eps, heads, kv_heads, head_dim)
    store_kv(k_cache, v_cache, slots, k, v)
    return q, k, v


def offset_qk_norm_rope_store(qkv: Tensor, cos: Tensor, sin: Tensor, q_weight: Tensor | None,
                              k_weight: Tensor | None, eps: float, heads: int, kv_heads: int,
                              head_dim: int, k_cache: Tensor, v_cache: Tensor,
                              slots: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``qk_norm_rope_store`` with Gemma's ``offset_rms_norm`` on q and k."""
    q, k, v = qk_norm_rope(qkv, cos, sin, q_weight, k_weight, eps, heads, kv_heads, head_dim,
                           norm=offset_rms_norm)
    store_kv(k_cache, v_cache, slots, k, v)
    return q, k, v


def gelu_tanh_mul(gate_up: Tensor) -> Tensor:
    """GeGLU with the tanh GeLU (``gelu_pytorch_tanh``): ``gelu_tanh(gate) * up``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def silu_mul(gate_up: Tensor) -> Tensor:
    """SwiGLU's activation: ``silu(gate) * up`` of the fused [T, 2 * inter] product."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _allow_recompiles(limit: int = 64) -> None:
    # Each model shape compiles a few times; the default limit (8) falls back to eager.
    config: Any = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), limit))


WARM_UP_ROWS = (2, 1)
"""Leading sizes a compiled function is first called with: 2 with the dim marked dynamic
(one compile for every size >= 2), then 1, which torch.compile always specializes."""


def dynamic_rows(*tensors: Tensor) -> tuple[Tensor, ...]:
    """``tensors`` with dim 0 marked dynamic when it is over 1 (see WARM_UP_ROWS)."""
    for t in tensors:
        if t.shape[0] > 1:
            torch._dynamo.mark_dynamic(t, 0)
    return tensors


def compiled(fn: Callable[..., Any], backend: str = "inductor") -> Callable[..., Any]:
    """``fn`` through ``torch.compile`` (whole graph; dims that vary become dynamic)."""
    _allow_recompiles()
    return torch.compile(fn, fullgraph=True, backend=backend)


def _native_rms_norm(k: NativeKernels) -> Callable[..., Any]:
    return lambda x, weight, eps: k.add_rms_norm(x, None, weight, eps)[0]


@frozen
class Op:
    """One op's implementations: torch (the reference, compiled or not), Triton, C.
    Invariant: each computes what the torch one does."""

    torch: Callable[..., Any]
    triton: Callable[..., Any] | None = None
    native: Callable[[NativeKernels], Callable[..., Any]] | None = None


ACTIVATIONS: Mapping[str, Op] = {
    "silu": Op(silu_mul, native=lambda k: k.silu_mul),
    "gelu_pytorch_tanh": Op(gelu_tanh_mul),  # no Triton or C kernel: torch (compiled) runs it
}
"""Gated activations by config.json's ``hidden_act``: ``act(gate) * up`` of [T, 2 * inter]."""

NORMS: Mapping[str, tuple[Op, Op]] = {
    "rms": (Op(rms_norm, native=_native_rms_norm),
            Op(add_rms_norm, native=lambda k: k.add_rms_norm)),
    # Gemma's (1 + w): torch only (the Triton and C kernels compute plain RMSNorm).
    "offset_rms": (Op(offset_rms_norm), Op(add_offset_rms_norm)),
}
"""Norm variants: (``norm(x, w, eps)``, ``add_norm(x, residual, w, eps) -> (norm(r), r)``)."""

QK_NORM_ROPE_STORE = Op(qk_norm_rope_store, triton=triton_ops.qk_norm_rope_store,
                        native=lambda k: k.qk_norm_rope_store)

QK_NORM_ROPE_STORES: Mapping[str, Op] = {
    "rms": QK_NORM_ROPE_STORE,
    "offset_rms": Op(offset_qk_norm_rope_store),
}
"""The q/k norm, rotary and KV store by norm variant (q and k take the model's norm)."""


INVARIANT_NORMS: Mapping[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "rms": (triton_invariant.rms_norm, triton_invariant.add_rms_norm),
    "offset_rms": (triton_invariant.offset_rms_norm, triton_invariant.add_offset_rms_norm),
}
"""The batch-invariant mode's norms on CUDA (Triton, one order of sums per row), by variant."""


def invariant_qk_norm_rope_store(norm: Callable[[Tensor, Tensor, float], Tensor]
                                 ) -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """``qk_norm_rope_store`` with ``norm`` on q's and k's heads; the rest is elementwise."""
    def store(qkv: Tensor, cos: Tensor, sin: Tensor, q_weight: Tensor | None,
              k_weight: Tensor | None, eps: float, heads: int, kv_heads: int, head_dim: int,
              k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = qk_norm_rope(qkv, cos, sin, q_weight, k_weight, eps, heads, kv_heads,
                               head_dim, norm=norm)
        store_kv(k_cache, v_cache, slots, k, v)
        return q, k, v
    return store


@frozen
class OpNames:
    """The elementwise ops a model chooses: its activation and its norm variant."""

    activation: str = "silu"
    norm: str = "rms"


@frozen
class WarmUpArgs:
    """One layer's sizes and weights, what ``LayerOps.warm_up`` calls each op with."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    qk_eps: float
    norm_weight: Tensor
    norm_eps: float
    q_norm_weight: Tensor | None = None
    k_norm_weight: Tensor | None = None


class LayerOps:
    """The ops a layer calls (``norm``, ``add_norm``, ``qk_norm_rope_store``, ``act``):
    C where ``native`` has them, else Triton when compiled where it runs, else torch;
    ``invariant``: the batch-invariant mode's Triton norms and eager torch for the rest;
    ``fp8_cache``: the KV store writes an FP8 pool, which the C kernel does not."""

    def __init__(self, names: OpNames | None = None, compile: bool = False,
                 backend: str = "inductor", device: torch.device | None = None,
                 native: NativeKernels | None = None, invariant: bool = False,
                 fp8_cache: bool = False) -> None:
        names = names or OpNames()
        self.names, self.compiled = names, compile and not invariant
        self.triton = compile and device is not None and triton_ops.available(device, "rope")
        if invariant:
            self.norm, self.add_norm = INVARIANT_NORMS[names.norm]
            self.qk_norm_rope_store = invariant_qk_norm_rope_store(self.norm)
            self.act = ACTIVATIONS[names.activation].torch
            return
        norm, add_norm = NORMS[names.norm]
        self.norm = self._pick(norm, backend, native)
        self.add_norm = self._pick(add_norm, backend, native)
        self.qk_norm_rope_store = self._pick(QK_NORM_ROPE_STORES[names.norm], backend,
                                             None if fp8_cache else native)
        self.act = self._pick(ACTIVATIONS[names.activation], backend, native)

    def _pick(self, op: Op, backend: str, native: NativeKernels | None) -> Callable[..., Any]:
        if native is not None and op.native is not None:
            return op.native(native)
        if self.triton and op.triton is not None:
            return op.triton
        return compiled(op.torch, backend) if self.compiled else op.torch

    @torch.inference_mode()
    def warm_up(self, args: WarmUpArgs, rotary: Any, k_cache: Tensor, v_cache: Tensor) -> None:
        """Compile every op for the token counts it will see (slot 0 of the caches is written)."""
        dtype, device = args.norm_weight.dtype, args.norm_weight.device
        qkv_width = (args.heads + 2 * args.kv_heads) * args.head_dim
        weight, eps = args.norm_weight, args.norm_eps
        for tokens in WARM_UP_ROWS:
            tables = rotary.lookup(torch.zeros(tokens, dtype=torch.int64, device=device),
                                   dtype)
            x, qkv, gate_up, slots, cos, sin = dynamic_rows(
                torch.zeros(tokens, args.hidden, dtype=dtype, device=device),
                torch.zeros(tokens, qkv_width, dtype=dtype, device=device),
                torch.zeros(tokens, 2 * args.intermediate, dtype=dtype, device=device),
                torch.zeros(tokens, dtype=torch.int64, device=device), *tables)
            self.norm(x, weight, eps)
            self.add_norm(x, x, weight, eps)
            self.qk_norm_rope_store(qkv, cos, sin, args.q_norm_weight, args.k_norm_weight,
                                    args.qk_eps, args.heads, args.kv_heads, args.head_dim,
                                    k_cache, v_cache, slots)
            self.act(gate_up)
