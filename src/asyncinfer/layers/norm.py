"""RMSNorm, computed in float32 the way transformers computes it (token-exactness depends on it)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    """y = w * x / rms(x), with the reduction in float32 and the scale in the input dtype.

    Half-precision activations on CUDA take torch's fused kernel instead (one launch instead
    of six; the product with ``w`` is then rounded once, not twice).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if x.is_cuda and dtype != torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
