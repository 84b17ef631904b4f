"""The CUDA attention backend: flashinfer's paged prefill (extend) and decode kernels.

The page table stays on the host. For each batch the runner turns it into flashinfer's paged
layout (``indptr``, page ``indices``, ``last_page_len``) in pinned memory; ``plan`` copies it
to the device without blocking, once per batch, and every layer reuses the plan.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

import numpy as np
import torch
from attrs import frozen

from asyncinfer.errors import ConfigError
from asyncinfer.kvcache.pool import KVPool

WORKSPACE_BYTES = 128 * 2**20     # flashinfer's recommended float workspace


def load_flashinfer(device: torch.device) -> ModuleType:
    """The flashinfer module, or a clear error saying why it cannot be used here."""
    if device.type != "cuda":
        raise ConfigError("attention_backend='flashinfer' needs a CUDA device; "
                          "use the torch backend on CPU")
    try:
        return importlib.import_module("flashinfer")
    except ImportError as exc:
        raise ConfigError("attention_backend='flashinfer' needs flashinfer-python "
                          "(pip install 'asyncinfer[cuda]')") from exc


@frozen
class PagedLayout:
    """One batch's KV in flashinfer's paged layout (int32, host; pinned on CUDA)."""

    indptr: torch.Tensor          # [B + 1] request i's pages are indices[indptr[i]:indptr[i+1]]
    indices: torch.Tensor         # [pages] page ids
    last_page_len: torch.Tensor   # [B] tokens in each request's last page
    seq_lens: torch.Tensor        # [B] KV length of each request


def paged_layout(page_table: torch.Tensor, rows: list[int], ends: list[int], page_size: int,
                 pad_to: int | None = None, pad_page: int = 0) -> PagedLayout:
    """Pages of positions ``[0, ends[i])`` of each row, read off the host page table.

    ``pad_to`` appends rows of one token on ``pad_page`` (a CUDA graph's unused rows).
    ``page_table`` is a CPU tensor.
    """
    lens = np.asarray(ends, np.int64)
    counts = (lens + page_size - 1) // page_size
    width = int(counts.max())
    # Every page_size-th slot of a row, divided by page_size, is the row's page list.
    pages = page_table.numpy()[:, ::page_size][np.asarray(rows), :width]
    indices = pages[np.arange(width) < counts[:, None]] // page_size
    if pad_to is not None and pad_to > len(rows):
        extra = pad_to - len(rows)
        indices = np.concatenate([indices, np.full(extra, pad_page, np.int64)])
        counts = np.concatenate([counts, np.ones(extra, np.int64)])
        lens = np.concatenate([lens, np.ones(extra, np.int64)])
    indptr = np.zeros(len(counts) + 1, np.int32)
    np.cumsum(counts, out=indptr[1:])
    last = lens - (counts - 1) * page_size
    return PagedLayout(torch.from_numpy(indptr),
                       *(torch.from_numpy(a.astype(np.int32)) for a in (indices, last, lens)))


def _decode_tensor_cores(group: int, device: torch.device) -> bool:
    """Whether decode runs flashinfer's tensor-core kernel (its prefill kernel) rather than
    its CUDA-core decode kernel.

    SGLang takes tensor cores once four or more query heads share a KV head. On Hopper
    they pay off already at two: on one H200, Qwen3-0.6B's shape (16 query, 8 KV heads)
    ran the offline workload in 5.82 s with them against 6.06 s without (same device call).
    ``ASYNCINFER_DECODE_TENSOR_CORES=1`` or ``0`` forces the choice, to measure both.
    """
    forced = os.environ.get("ASYNCINFER_DECODE_TENSOR_CORES")
    if forced in ("0", "1"):
        return forced == "1"
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return group >= 4 or hopper


class HostLengths(torch.Tensor):
    """A host int32 tensor whose iteration yields numpy scalars.

    flashinfer's ``plan`` takes Python's builtin ``max()`` over the lengths it is handed
    (the KV lengths for tensor-core decode and prefill, the query lengths for prefill).
    Over a plain tensor that makes a 0-d tensor per element: 1.2 ms for 256 requests on
    the dev machine, every decode step; over this, 45 µs. Everything else flashinfer does
    with it, including passing it to its C++ plan (through DLPack), sees a plain tensor.
    """

    def __iter__(self) -> Any:
        return iter(self.numpy())


def host_lengths(tensor: torch.Tensor) -> HostLengths:
    """``tensor`` (int32, on the host) as a HostLengths, without a copy."""
    return tensor.as_subclass(HostLengths)


@frozen
class FlashInferMetadata:
    """What every layer of one forward needs: the planned wrapper and each token's KV slot."""

    wrapper: Any
    out_loc: torch.Tensor     # [T] on the device


class FlashInferBackend:
    """Plans one wrapper per batch and runs it for every layer over the page pool.

    Prefill and mixed batches use the paged prefill wrapper (causal, queries aligned to the
    end of each request's KV, so extending a cached prefix needs nothing more); decode
    batches use the decode wrapper, or a CUDA-graph one per captured batch size.
    """

    def __init__(self, flashinfer: ModuleType, pool: KVPool, num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.fi, self.pool, self.device, self.dtype = flashinfer, pool, device, dtype
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.decode_tensor_cores = _decode_tensor_cores(num_heads // num_kv_heads, device)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend="fa2")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.decode_tensor_cores)
        self._plan_events: dict[int, torch.cuda.Event] = {}
        shape = (pool.num_pages, pool.page_size, num_kv_heads, head_dim)
        self._pages = [(pool.k[i].view(shape), pool.v[i].view(shape))
                       for i in range(pool.k.shape[0])]

    def graph_decode_wrapper(self, batch_size: int, indptr: torch.Tensor,
                             indices: torch.Tensor, last_page_len: torch.Tensor) -> Any:
        """A decode wrapper for CUDA graphs of ``batch_size``, on fixed device buffers."""
        return self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True,
            use_tensor_cores=self.decode_tensor_cores,
            paged_kv_indptr_buffer=indptr[: batch_size + 1],
            paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last_page_len[:batch_size])

    def plan_decode(self, wrapper: Any, layout: PagedLayout) -> None:
        """Plan a decode wrapper for one batch."""
        self._plan(wrapper, lambda: wrapper.plan(
            layout.indptr, layout.indices, layout.last_page_len, self.num_heads,
            self.num_kv_heads, self.head_dim, self.pool.page_size, q_data_type=self.dtype,
            kv_data_type=self.dtype, sm_scale=self.scale,
            seq_lens=host_lengths(layout.seq_lens)))

    def plan_prefill(self, layout: PagedLayout, qo_indptr: torch.Tensor) -> None:
        """Plan the prefill wrapper: ``qo_indptr`` splits the batch's new tokens by request."""
        self._plan(self.prefill, lambda: self.prefill.plan(
            host_lengths(qo_indptr), layout.indptr, layout.indices, layout.last_page_len,
            self.num_heads, self.num_kv_heads, self.head_dim, self.pool.page_size,
            causal=True, sm_scale=self.scale, q_data_type=self.dtype,
            kv_data_type=self.dtype, seq_lens=host_lengths(layout.seq_lens)))

    def _plan(self, wrapper: Any, plan: Any) -> None:
        # plan() stages its schedule in a pinned buffer of the wrapper and uploads it without
        # blocking. With the next batch planned while one runs, that buffer must not be
        # rewritten before the last upload from it ran: wait for that upload (long done in
        # practice: it is the first thing the previous batch did on the stream).
        previous = self._plan_events.get(id(wrapper))
        if previous is not None:
            previous.synchronize()
        plan()
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._plan_events[id(wrapper)] = event

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: FlashInferMetadata) -> torch.Tensor:
        """Attend over each request's pages (the new K, V are already in them)."""
        out = meta.wrapper.run(q.contiguous(), self._pages[layer])
        return out.view(q.shape[0], -1)
