"""The attention backend protocol and the context the model calls attention through."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from asyncinfer.engine.batch import Batch


class AttentionKernel(Protocol):
    """Runs attention for one layer over the paged KV pool, given a batch's metadata."""

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any
    ) -> torch.Tensor:
        """Store the new k, v and attend: q [T, heads, dim] -> [T, heads * dim]."""
        ...


class AttentionBackend(AttentionKernel, Protocol):
    """Plans attention once per batch and runs it for every layer (the torch backend; the
    flashinfer backend is planned by its runner, which knows the host page table)."""

    def prepare(self, batch: Batch, row_index: torch.Tensor, positions: torch.Tensor) -> Any:
        """Metadata for one batch; ``row_index``/``positions`` list each computed token."""
        ...


class AttentionContext:
    """The backend bound to one batch's metadata; passed down the model, never global."""

    def __init__(self, backend: AttentionKernel, meta: Any) -> None:
        self.backend = backend
        self.meta = meta

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return self.backend.forward(layer, q, k, v, self.meta)
