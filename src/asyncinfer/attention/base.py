"""The attention backend protocol and the context the model calls attention through.

A backend turns one batch into metadata once (``plan``) and attends with it in every layer
(``forward``). Backends that can be captured in CUDA graphs (``capturable``) also keep static
metadata per captured graph and refill it for the real batch before each replay;
``engine.cuda_graph`` drives those through this protocol alone. The runner picks a backend
class by name from ``attention.registry``.

==================================  =========================================================
member                              what it does
==================================  =========================================================
``capturable``                      whether the graph members below work
``check(device, dtype)``            refuse a device or dtype before the model loads
``plan(batch, out_loc)``            once per batch: metadata from its rows, extents and phase
                                    and the host page table, uploaded without blocking
``forward(layer, q, k, v, meta)``   attention for one layer; the new K, V are in the pool
``init_graph_state(shapes)``        the static buffers shared by graphs of these shapes
``graph_metadata(shape, out_loc)``  the metadata one graph (a ``GraphShape``) is captured with
``prepare_replay(meta, rows,        refill that graph's buffers for a real batch, padded
starts, ends)``                     to its shape with requests on the pad page
==================================  =========================================================
"""

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
    tokens, replayed for any batch of the ``phase`` that fits in it.

    A decode graph has one token per row (``tokens == rows``); a batch of ``n <= rows``
    requests pads it with rows of one token that attend one token of the pad page. A prefill
    graph (prompts, chunks, and those mixed with decoding requests) takes a batch of
    ``n < rows`` requests and ``t <= tokens`` tokens: its row ``rows - 1`` is a padding
    request that owns the ``tokens - t`` padding tokens at the end of the token axis (their
    K, V on the pad page, where they attend), and rows ``n .. rows - 2`` are padding requests
    with no token that hold one KV token of the pad page.
    """

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


class AttentionBackend(Protocol):
    """Plans attention once per batch, runs it for every layer, and (where ``capturable``)
    supplies what CUDA graphs of decode and prefill batches need.

    Planning reads the host: the batch's rows and extents, the host page table. Everything
    it uploads is ordered on the current stream, so planning batch N+1 never waits for
    batch N.
    """

    pool: KVPool
    capturable: ClassVar[bool]    # whether ``init_graph_state`` and the rest work

    def plan(self, batch: Batch, out_loc: torch.Tensor) -> Any:
        """Metadata for one batch, which every layer's ``forward`` reuses. ``out_loc``
        [T] (on the device) is the KV slot of each computed token, in batch order."""
        ...

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: Any) -> torch.Tensor:
        """Attend: q [T, heads, dim] -> [T, heads * dim]. The new k, v are already in the
        pool at ``meta.out_loc`` (the model writes them: ``AttentionContext.kv_slots``)."""
        ...

    def init_graph_state(self, shapes: Sequence[GraphShape]) -> None:
        """Allocate the static buffers that graphs of these ``shapes`` share (called once,
        with every graph that will be captured, before ``graph_metadata``)."""
        ...

    def graph_metadata(self, shape: GraphShape, out_loc: torch.Tensor) -> Any:
        """The metadata a graph of ``shape`` is captured with: its tensors stay where they
        are across replays. ``out_loc`` [shape.tokens] is the graph's own KV-slot buffer
        (refilled by the caller before each replay, padding tokens on the pad page)."""
        ...

    def prepare_replay(self, meta: Any, rows: Sequence[int], starts: Sequence[int],
                       ends: Sequence[int]) -> None:
        """Refill ``meta``'s buffers, in stream order, for a batch whose request ``i``
        computes positions ``[starts[i], ends[i])`` of table row ``rows[i]``; the graph's
        remaining rows and tokens are padding on ``AttentionSpec.pad_page``, laid out as
        ``GraphShape`` says."""
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
        """The layer's K and V caches and each new token's slot in them: the model writes
        the new K, V there (in the kernel that produces them) before it attends."""
        pool = self.backend.pool
        return pool.k[layer], pool.v[layer], self.meta.out_loc

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        return self.backend.forward(layer, q, k, v, self.meta)
