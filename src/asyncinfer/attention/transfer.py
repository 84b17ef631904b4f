"""Host-to-device copies that never block the host: pinned memory, non-blocking copies.

A copy from pageable memory (``torch.tensor(..., device="cuda")``, ``.to("cuda")``) makes the
host wait for every kernel queued before it, which would undo the overlap of scheduling with
compute. Copies made here are ordered on the current stream instead. The attention
backends upload their plans through these, and the runner its inputs.
"""

from __future__ import annotations

import torch


def pin(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A page-locked copy of a host tensor bound for ``device`` (unchanged off CUDA)."""
    return tensor.pin_memory() if device.type == "cuda" else tensor


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``, copied without blocking the host."""
    return pin(tensor, device).to(device, non_blocking=True)
