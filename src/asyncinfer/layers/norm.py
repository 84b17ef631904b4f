"""RMSNorm, computed in float32 the way transformers computes it (token-exactness depends on it)."""

from __future__ import annotations

import torch
from torch import nn

from asyncinfer.layers.fused import offset_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """y = w * x / rms(x), with the reduction in float32 and the scale in the input dtype
    (see ``layers.fused.rms_norm``; the model calls that with this module's weight)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class OffsetRMSNorm(RMSNorm):
    """Gemma's y = (1 + w) * x / rms(x) (see ``layers.fused.offset_rms_norm``); ``w`` starts
    at zero, as checkpoints store it."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return offset_rms_norm(x, self.weight, self.eps)
