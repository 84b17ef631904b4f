"""Host-to-device copies that never block the host: pinned memory, non-blocking copies."""

from __future__ import annotations

import torch


def pin(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A page-locked copy of a host tensor bound for ``device`` (unchanged off CUDA)."""
    return tensor.pin_memory() if device.type == "cuda" else tensor


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``, copied without blocking the host."""
    return pin(tensor, device).to(device, non_blocking=True)
