"""The fused MoE on CUDA: a Triton grouped GEMM over the (token, k) pairs sorted by expert,
each block of BLOCK_M pairs belonging to one expert. Reference: ``layers.fused_moe.
grouped_moe``. See docs/architecture.md, 'Mixture of experts'.

Every shape is fixed by (tokens, k, E): the sort and the block table are device ops with no
host sync, so a CUDA graph can hold them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

Tensor = torch.Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None

BLOCK_M = 16


def available(device: torch.device) -> bool:
    """Whether the kernel runs on ``device`` (CUDA, or any under ``TRITON_INTERPRET=1``)."""
    return triton is not None and (device.type == "cuda"
                                   or os.environ.get("TRITON_INTERPRET") == "1")


def align_blocks(topk_ids: Tensor, experts: int, block_m: int = BLOCK_M
                 ) -> tuple[Tensor, Tensor]:
    """``(sorted_pairs, block_expert)``: the pair indices (t * k + j) grouped by expert, each
    group padded to a multiple of ``block_m`` with the index T*k (no pair), and each block's
    expert (E past the last group). Lengths depend only on the shapes."""
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat.index_select(0, order)
    rank = torch.arange(pairs, device=device) - start.index_select(0, expert_of)
    capacity = -(-(pairs + experts * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((capacity,), pairs, dtype=torch.int64, device=device)
    sorted_pairs.scatter_(0, padded_start.index_select(0, expert_of) + rank, order)
    block_first = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_first, right=True)
    return sorted_pairs, block_expert


if triton is not None:

    @triton.jit
    def _grouped_gemm_kernel(  # type: ignore[no-untyped-def]
            a, w, out, sorted_pairs, block_expert, route, pairs,
            a_stride, w_stride_e, w_stride_n, out_stride, N: tl.constexpr, K: tl.constexpr,
            A_ROW_DIV: tl.constexpr, WEIGH: tl.constexpr, EXPERTS: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr) -> None:
        # Program (m, n): pairs [m * BLOCK_M, ...) of one expert, output columns
        # [n * BLOCK_N, ...). out[pair] = a[pair // A_ROW_DIV] @ w[e]ᵀ (× route[pair]).
        block = tl.program_id(0)
        expert = tl.load(block_expert + block)
        if expert >= EXPERTS:
            return
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_pairs + rows)
        live = pair < pairs
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_live = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        a_rows = a + (pair // A_ROW_DIV).to(tl.int64)[:, None] * a_stride
        w_rows = w + expert.to(tl.int64) * w_stride_e + cols[None, :] * w_stride_n
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_live = ks < K
            x = tl.load(a_rows + ks[None, :], mask=live[:, None] & k_live[None, :], other=0.0)
            y = tl.load(w_rows + ks[:, None], mask=k_live[:, None] & col_live[None, :],
                        other=0.0)
            acc += tl.dot(x, y, input_precision="ieee")
        if WEIGH:
            acc = acc * tl.load(route + pair, mask=live, other=0.0).to(tl.float32)[:, None]
        dest = out + pair.to(tl.int64)[:, None] * out_stride + cols[None, :]
        tl.store(dest, acc.to(out.dtype.element_ty), mask=live[:, None] & col_live[None, :])


def _grouped_gemm(a: Tensor, w: Tensor, sorted_pairs: Tensor, block_expert: Tensor,
                  pairs: int, a_row_div: int, route: Tensor | None, dtype: torch.dtype
                  ) -> Tensor:
    experts, n, k_dim = w.shape
    out = torch.empty(pairs, n, dtype=dtype, device=a.device)
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 64 if k_dim >= 64 else max(16, triton.next_power_of_2(k_dim))
    grid: Any = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, sorted_pairs, block_expert, route if route is not None else out, pairs,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), N=n, K=k_dim,
        A_ROW_DIV=a_row_div, WEIGH=route is not None, EXPERTS=experts,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def fused_moe(x: Tensor, w13: Tensor, w2: Tensor, topk_ids: Tensor, topk_weights: Tensor,
              act: Callable[[Tensor], Tensor]) -> Tensor:
    """What ``grouped_moe`` computes: two grouped GEMMs (gate/up over x's rows, down over
    the activations, weighted), then each token's k outputs summed."""
    tokens, top_k = topk_ids.shape
    pairs = tokens * top_k
    sorted_pairs, block_expert = align_blocks(topk_ids, w13.shape[0])
    gate_up = _grouped_gemm(x.contiguous(), w13, sorted_pairs, block_expert, pairs, top_k,
                            None, x.dtype)
    h = act(gate_up).contiguous()
    route = topk_weights.reshape(-1).contiguous()
    down = _grouped_gemm(h, w2, sorted_pairs, block_expert, pairs, 1, route, x.dtype)
    return down.view(tokens, top_k, -1).sum(1)
