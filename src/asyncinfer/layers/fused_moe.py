"""A layer's experts as two fused weights, w13 [E, 2I, H] (gate rows, then up rows) and
w2 [E, H, I], and their grouped product: tokens sorted by expert, each expert computed once
over its tokens. CUDA runs the Triton kernel (``layers.triton_moe``). See
docs/architecture.md, 'Mixture of experts'."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from asyncinfer.layers import triton_moe
from asyncinfer.layers.linear import PACKED_ROWS, PackedWeight, pack_weight

if TYPE_CHECKING:
    from asyncinfer.kernels.cpu import NativeKernels
    from asyncinfer.memory import Slab

Tensor = torch.Tensor
Packed = Sequence[tuple[PackedWeight, PackedWeight]]


def expert_linear(x: Tensor, weight: Tensor) -> Tensor:
    """One expert's product over the rows routed to it: ``x Wᵀ``."""
    return F.linear(x, weight)


def grouped_moe(x: Tensor, w13: Tensor, w2: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                act: Callable[[Tensor], Tensor], packed: Packed | None = None,
                packed_rows: int | None = None) -> Tensor:
    """``sum_k weight[t, k] * down_e(act(gate_up_e(x[t])))`` for e = topk_ids[t, k].

    The (token, k) pairs are sorted by expert; each expert with tokens runs two products over
    its rows, so the products per call are at most 2 E whatever the token count. Each
    product's output rounds to ``x.dtype`` (the weights may be a float32 shadow); the routing
    weight multiplies in its own dtype; the sum runs in ``x.dtype`` in expert order, as
    transformers' loop over experts adds them. ``packed``: each expert's (w13, w2) packed
    for this CPU, used for groups of at most ``packed_rows`` rows (None: every group).
    """
    tokens, top_k = topk_ids.shape
    experts = len(packed) if packed is not None else w13.shape[0]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts).tolist()
    token_of = order // top_k
    rows = x.index_select(0, token_of)
    compute = w13.dtype
    out = torch.empty(rows.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        group = rows[start : start + n]
        if packed is not None and (packed_rows is None or n <= packed_rows):
            up, down = packed[e]
            out[start : start + n] = down(act(up(group)))
        else:
            h = act(expert_linear(group.to(compute), w13[e]).to(x.dtype))
            out[start : start + n] = expert_linear(h.to(compute), w2[e]).to(x.dtype)
        start += n
    weights = topk_weights.reshape(-1).index_select(0, order)
    out = (out * weights.unsqueeze(1)).to(x.dtype)
    return torch.zeros(tokens, x.shape[1], dtype=x.dtype, device=x.device).index_add_(
        0, token_of, out)


class Experts(nn.Module):
    """E gated experts of width I (this rank's share under tp) over hidden size H.
    Invariant: ``w13[e]`` is [gate_e; up_e], ``w2[e]`` is down_e."""

    def __init__(self, experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate = experts, intermediate
        self.w13 = nn.Parameter(torch.empty(experts, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, intermediate))
        self.shadow: tuple[Tensor, Tensor] | None = None
        self.packed: list[tuple[PackedWeight, PackedWeight]] | None = None
        self.packed_rows: int | None = None  # above this many rows, the plain weights

    def load(self, expert: int, part: str, weight: Tensor) -> None:
        """Copy one expert's checkpoint tensor: ``part`` "gate", "up" or "down"."""
        i = self.intermediate
        target = {"gate": self.w13[expert, :i], "up": self.w13[expert, i:],
                  "down": self.w2[expert]}[part]
        assert target.shape == weight.shape, f"{part}: {tuple(weight.shape)} vs " \
                                             f"{tuple(target.shape)}"
        with torch.no_grad():
            target.copy_(weight)

    def use_fp32_shadow(self) -> None:
        """Multiply in float32 from now on, through float32 copies that replace the weights."""
        self.shadow = (self.w13.detach().float(), self.w2.detach().float())
        if self.w13.dtype != torch.float32:
            self.w13.data = self.w13.data.new_empty(0)
            self.w2.data = self.w2.data.new_empty(0)

    def weights(self) -> list[Tensor]:
        """Each expert's two weights, as a packing pass sizes them."""
        return [w for e in range(self.num_experts) for w in (self.w13[e], self.w2[e])]

    def pack_for_cpu(self, rows_hint: int, keep_plain: bool = True,
                     kernels: NativeKernels | None = None, slab: Slab | None = None) -> None:
        """Multiply through each expert's packed copies from now on (as ``Linear`` does)."""
        self.packed = [(pack_weight(self.w13[e], rows_hint, kernels, slab),
                        pack_weight(self.w2[e], rows_hint, kernels, slab))
                       for e in range(self.num_experts)]
        all_rows = all(p.takes_all_rows for pair in self.packed for p in pair)
        self.packed_rows = None if all_rows or not keep_plain else PACKED_ROWS
        if not keep_plain:
            self.w13.data = self.w13.data.new_empty(0)
            self.w2.data = self.w2.data.new_empty(0)

    def forward(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                act: Callable[[Tensor], Tensor]) -> Tensor:
        """[T, H] from x [T, H] and each token's experts and weights [T, k]."""
        w13, w2 = self.shadow if self.shadow is not None else (self.w13, self.w2)
        if x.is_cuda and triton_moe.available(x.device):
            return triton_moe.fused_moe(x, w13, w2, topk_ids, topk_weights, act)
        return grouped_moe(x, w13, w2, topk_ids, topk_weights, act, self.packed,
                           self.packed_rows)
