"""The attention backend protocol and the context the model calls attention through."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from asyncinfer.core import Batch
from asyncinfer.kvcache.pool import KVPool


class AttentionKernel(Protocol):
    """Runs attention for one layer over the paged KV pool, given a batch's metadata."""

    pool: KVPool

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: Any) -> torch.Tensor:
        """Attend: q [T, heads, dim] -> [T, heads * dim]. The new k, v are already in the
        pool at ``meta.out_loc`` (the model writes them: ``AttentionContext.kv_slots``)."""
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

    def kv_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's K and V caches and each new token's slot in them: the model writes
        the new K, V there (in the kernel that produces them) before it attends."""
        pool = self.backend.pool
        return pool.k[layer], pool.v[layer], self.meta.out_loc

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        return self.backend.forward(layer, q, k, v, self.meta)
