"""RMSNorm, computed in float32 the way transformers computes it (token-exactness depends on it)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = w * x / rms(x), with the reduction in float32 and the scale in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
