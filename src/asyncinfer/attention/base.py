"""The attention backend protocol and the context the model calls attention through.
See docs/architecture.md, 'Attention backends'."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal, Protocol

import torch
from attrs import frozen

from asyncinfer.core import Batch
from asyncinfer.kvcache.pool import KVPool

Phase = Literal["prefill", "decode"]   # as ``Batch.phase``


@frozen
class GraphShape:
    """What one captured forward is built for: ``rows`` request rows over ``tokens`` query
    tokens, for any batch of ``phase`` that fits (padding: docs/architecture.md, 'CUDA
    graphs')."""

    phase: Phase
    rows: int
    tokens: int


@frozen
class AttentionSpec:
    """What a backend is built for: the KV pool, the page table and the model's shape."""

    pool: KVPool
    page_table: torch.Tensor      # [rows, width] on the host: KV slot of each position
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    dtype: torch.dtype            # of queries and of the values the pool holds
    device: torch.device
    pad_page: int | None          # page that takes padding rows' K, V (capturable backends)
    native: bool = False          # CPU: use the compiled kernels (kernels.cpu) if they build
    windows: tuple[int | None, ...] = ()  # each layer's sliding window (None: full attention)
    invariant: bool = False       # batch-invariant: every query in one fixed order of sums

    def planned_windows(self) -> tuple[int | None, ...]:
        """The distinct windows a plan serves: the layers' own (no layers named: full
        attention only), full attention first."""
        found = {full_if_wider(w, self.page_table.shape[1]) for w in self.windows} or {None}
        return tuple(sorted(found, key=lambda w: -1 if w is None else w))


def full_if_wider(window: int | None, positions: int) -> int | None:
    """``window``, or None where it spans all ``positions`` a request can reach. A query at
    position p attends keys p - window + 1 .. p (transformers' sliding window; flashinfer's
    ``window_left`` is window - 1). See docs/architecture.md, 'Sliding windows'."""
    return None if window is None or window >= positions else window


class AttentionBackend(Protocol):
    """Plans attention once per batch, runs it for every layer, and (where ``capturable``)
    supplies what CUDA graphs need. Invariant: planning uploads in stream order only."""

    pool: KVPool
    capturable: ClassVar[bool]    # whether ``init_graph_state`` and the rest work

    def plan(self, batch: Batch, out_loc: torch.Tensor) -> Any:
        """Metadata every layer reuses; ``out_loc`` [T] (device): each token's KV slot."""
        ...

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: Any, window: int | None = None) -> torch.Tensor:
        """Attend: q [T, heads, dim] -> [T, heads * dim]; k, v are in the pool already;
        ``window``: the layer's sliding window (None: every earlier key), one the spec's
        ``windows`` named."""
        ...

    def init_graph_state(self, shapes: Sequence[GraphShape]) -> None:
        """Allocate the static buffers graphs of ``shapes`` share (once, first)."""
        ...

    def graph_metadata(self, shape: GraphShape, out_loc: torch.Tensor) -> Any:
        """The metadata a graph of ``shape`` is captured with (its tensors stay put);
        ``out_loc`` [shape.tokens]: the graph's KV-slot buffer."""
        ...

    def prepare_replay(self, meta: Any, rows: Sequence[int], starts: Sequence[int],
                       ends: Sequence[int]) -> None:
        """Refill ``meta``'s buffers, in stream order, for requests computing positions
        ``[starts[i], ends[i])`` of rows ``rows[i]``; the rest is padding on the pad page."""
        ...


class AttentionBackendClass(Protocol):
    """What the registry holds: a backend class, checked for the device before it is built."""

    capturable: bool

    def check(self, device: torch.device, dtype: torch.dtype) -> None:
        """Raise ConfigError when the backend cannot run here (before the model loads)."""
        ...

    def __call__(self, spec: AttentionSpec) -> AttentionBackend:
        ...


class AttentionContext:
    """The backend bound to one batch's metadata; passed down the model, never global."""

    def __init__(self, backend: AttentionBackend, meta: Any) -> None:
        self.backend = backend
        self.meta = meta

    def kv_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's K and V caches and each new token's slot, written before attending."""
        pool = self.backend.pool
        return pool.k[layer], pool.v[layer], self.meta.out_loc

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 window: int | None = None) -> torch.Tensor:
        return self.backend.forward(layer, q, k, v, self.meta, window)
