"""Linear layers that load several checkpoint tensors into one fused weight (q/k/v, gate/up)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class MergedLinear(nn.Module):
    """One matmul for several projections of the same input; ``load(i, w)`` fills part i."""

    def __init__(self, in_features: int, out_features: list[int], bias: bool = False) -> None:
        super().__init__()
        self.sizes = list(out_features)
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.weight = nn.Parameter(torch.empty(sum(self.sizes), in_features))
        self.bias = nn.Parameter(torch.zeros(sum(self.sizes))) if bias else None

    def load(self, part: int, weight: torch.Tensor, is_bias: bool = False) -> None:
        """Copy a checkpoint tensor into rows of the fused parameter."""
        target = self.bias if is_bias else self.weight
        assert target is not None
        start, size = self.offsets[part], self.sizes[part]
        assert weight.shape[0] == size, f"part {part}: {tuple(weight.shape)} vs {size} rows"
        with torch.no_grad():
            target[start : start + size].copy_(weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
