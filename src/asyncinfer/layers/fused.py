"""The elementwise work between a decoder layer's matrix products, one function per gap.

Each function is plain torch, written to compute exactly what transformers computes (the CPU
path is token-exact with it). On CUDA in half precision ``LayerOps(compile=True)`` hands each
one to ``torch.compile``, which fuses it into a kernel or two: a layer then runs about a
dozen kernels instead of about thirty (rotary alone was ten), and a decode step is bound by
memory traffic rather than by the count of tiny kernels.

The new K and V are written to the page pool by the same function that rotates them
(``qk_norm_rope_store``): inductor turns the assignment into a scatter inside that kernel,
in place, as it does for gpt-fast's static caches. Attention itself stays outside.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import functional as F

from asyncinfer.kvcache.pool import store_kv
from asyncinfer.layers import triton_ops

if TYPE_CHECKING:
    from asyncinfer.kernels.cpu import NativeKernels

Tensor = torch.Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * x / rms(x)``: the reduction in float32, the scale in the input dtype.

    Half-precision activations on CUDA take torch's fused kernel when run eagerly (under
    ``torch.compile`` the decomposition is fused anyway).
    """
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


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def qk_norm_rope(qkv: Tensor, cos: Tensor, sin: Tensor, q_weight: Tensor | None,
                 k_weight: Tensor | None, eps: float, heads: int, kv_heads: int,
                 head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Split the fused qkv product [T, (heads + 2 kv_heads) * dim] into q, k, v, apply
    Qwen3's per-head RMSNorm to q and k when weights are given, and rotate q and k.

    ``cos``/``sin`` are [T, 1, dim] in the activations' dtype. Returns q [T, heads, dim],
    k and v [T, kv_heads, dim] (v a view of ``qkv``).
    """
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(-1, heads, head_dim)
    k = k.view(-1, kv_heads, head_dim)
    v = v.view(-1, kv_heads, head_dim)
    if q_weight is not None and k_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v


def qk_norm_rope_store(qkv: Tensor, cos: Tensor, sin: Tensor, q_weight: Tensor | None,
                       k_weight: Tensor | None, eps: float, heads: int, kv_heads: int,
                       head_dim: int, k_cache: Tensor, v_cache: Tensor,
                       slots: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``qk_norm_rope``, then the new k and v written to their ``slots`` of the layer's
    caches [slots, kv_heads, dim] (widened if the cache is). Compiled, the K write happens
    in the kernel that norms and rotates k, and V's is one small kernel: three kernels
    where eager Qwen3 ran about fourteen."""
    q, k, v = qk_norm_rope(qkv, cos, sin, q_weight, k_weight, eps, heads, kv_heads, head_dim)
    store_kv(k_cache, v_cache, slots, k, v)
    return q, k, v


def silu_mul(gate_up: Tensor) -> Tensor:
    """SwiGLU's activation: ``silu(gate) * up`` of the fused [T, 2 * inter] product."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _allow_recompiles(limit: int = 64) -> None:
    # Each model shape, a first static batch size and batch size 1 compile once per
    # function; the default limit (8) would quietly fall back to eager in a process that
    # serves or tests several models.
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


class LayerOps:
    """The functions a layer calls between its matrix products: eager, compiled, or our CPU
    kernels.

    ``backend`` is torch.compile's ("inductor" on CUDA; tests on a CPU use "aot_eager",
    which traces the same graphs without generating code). Compiled on a ``device`` where
    Triton runs, ``qk_norm_rope_store`` is the hand-written kernel of layers.triton_ops.
    With ``native`` (asyncinfer.kernels.cpu, for bfloat16 activations on a CPU) each
    function is one C pass over the rows instead of eight to fifteen torch ops.
    """

    def __init__(self, compile: bool = False, backend: str = "inductor",
                 device: torch.device | None = None, native: NativeKernels | None = None
                 ) -> None:
        self.compiled = compile
        wrap: Callable[[Callable[..., Any]], Callable[..., Any]] = (
            (lambda fn: compiled(fn, backend)) if compile else (lambda fn: fn))
        self.rms_norm = wrap(rms_norm)
        self.add_rms_norm = wrap(add_rms_norm)
        # Inductor makes three kernels of this one; a hand-written Triton kernel does it in
        # one where it can run (compiled engines on CUDA).
        self.triton = compile and device is not None and triton_ops.available(device, "rope")
        self.qk_norm_rope_store = (triton_ops.qk_norm_rope_store if self.triton
                                   else wrap(qk_norm_rope_store))
        self.silu_mul = wrap(silu_mul)
        if native is not None:
            self.rms_norm = lambda x, weight, eps: native.add_rms_norm(x, None, weight, eps)[0]
            self.add_rms_norm = native.add_rms_norm
            self.qk_norm_rope_store = native.qk_norm_rope_store
            self.silu_mul = native.silu_mul

    @torch.inference_mode()
    def warm_up(self, layer: Any, rotary: Any, embedding: Tensor, k_cache: Tensor,
                v_cache: Tensor) -> None:
        """Compile every function for the token counts it will see: any count (dynamic),
        and 1, which torch.compile specializes. ``layer`` is a DecoderLayer of the model;
        the caches are a layer's of the (still empty) pool: slot 0 is written."""
        attn = layer.self_attn
        hidden, dtype, device = embedding.shape[1], embedding.dtype, embedding.device
        qkv_width = (attn.heads + 2 * attn.kv_heads) * attn.head_dim
        inter = layer.mlp.down_proj.weight.shape[1]
        norm = layer.input_layernorm
        q_w = None if attn.q_norm is None else attn.q_norm.weight
        k_w = None if attn.k_norm is None else attn.k_norm.weight
        for tokens in WARM_UP_ROWS:
            tables = rotary.lookup(torch.zeros(tokens, dtype=torch.int64, device=device),
                                   dtype)
            x, qkv, gate_up, slots, cos, sin = dynamic_rows(
                torch.zeros(tokens, hidden, dtype=dtype, device=device),
                torch.zeros(tokens, qkv_width, dtype=dtype, device=device),
                torch.zeros(tokens, 2 * inter, dtype=dtype, device=device),
                torch.zeros(tokens, dtype=torch.int64, device=device), *tables)
            self.rms_norm(x, norm.weight, norm.eps)
            self.add_rms_norm(x, x, norm.weight, norm.eps)
            self.qk_norm_rope_store(qkv, cos, sin, q_w, k_w, attn.eps,
                                    attn.heads, attn.kv_heads, attn.head_dim, k_cache,
                                    v_cache, slots)
            self.silu_mul(gate_up)
