"""The CUDA attention backend: flashinfer's paged prefill (extend) and decode kernels.
See docs/architecture.md, 'The flashinfer backend'."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any, ClassVar

import numpy as np
import torch
from attrs import frozen

from asyncinfer.attention.base import AttentionSpec, GraphShape, full_if_wider
from asyncinfer.attention.host_to_device import pin, upload
from asyncinfer.attention.xqa_decode import (
    XQA_WORKSPACE_BYTES,
    XqaDecode,
    block_tables,
    decodes_with_xqa,
)
from asyncinfer.core import Batch
from asyncinfer.errors import ConfigError

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


def paged_layout(page_table: torch.Tensor, rows: Sequence[int], ends: Sequence[int],
                 page_size: int, pad_lens: Sequence[int] = (), pad_page: int = 0
                 ) -> PagedLayout:
    """Pages of ``[0, ends[i])`` of each row, plus padding rows of ``pad_lens`` on ``pad_page``."""
    lens = np.asarray(ends, np.int64)
    counts = (lens + page_size - 1) // page_size
    width = int(counts.max())
    # Every page_size-th slot of a row, divided by page_size, is the row's page list.
    pages = page_table.numpy()[:, ::page_size][np.asarray(rows), :width]
    indices = pages[np.arange(width) < counts[:, None]] // page_size
    if len(pad_lens):
        extra = np.asarray(pad_lens, np.int64)
        extra_counts = (extra + page_size - 1) // page_size
        indices = np.concatenate([indices, np.full(int(extra_counts.sum()), pad_page,
                                                   np.int64)])
        counts = np.concatenate([counts, extra_counts])
        lens = np.concatenate([lens, extra])
    indptr = np.zeros(len(counts) + 1, np.int32)
    np.cumsum(counts, out=indptr[1:])
    last = lens - (counts - 1) * page_size
    return PagedLayout(torch.from_numpy(indptr),
                       *(torch.from_numpy(a.astype(np.int32)) for a in (indices, last, lens)))


def prefill_graph_workspace_bytes(shape: GraphShape, num_heads: int, num_kv_heads: int,
                                  head_dim: int, num_sms: int) -> int:
    """The most float workspace flashinfer's prefill plan takes for a graph of ``shape``."""
    group = num_heads // num_kv_heads
    tile_rows = max(2 * num_sms // num_kv_heads * 128, shape.tokens * group + shape.rows * 128)
    return num_heads * tile_rows * (head_dim + 1) * 4 + 64   # 64: two aligned allocations


def _decode_tensor_cores(group: int, device: torch.device) -> bool:
    """Whether decode takes the tensor-core kernel: from 4 heads per KV head (Hopper: 2)."""
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return group >= 4 or hopper


class HostLengths(torch.Tensor):
    """A host int32 tensor whose iteration yields numpy scalars (for ``plan``'s ``max()``)."""

    def __iter__(self) -> Any:
        return iter(self.numpy())


def host_lengths(tensor: torch.Tensor) -> HostLengths:
    """``tensor`` (int32, on the host) as a HostLengths, without a copy."""
    return tensor.as_subclass(HostLengths)


@frozen
class FlashInferMetadata:
    """What every layer of one forward needs: a wrapper planned for each sliding window the
    layers use (None: full attention), each token's KV slot."""

    wrappers: dict[int | None, Any]
    out_loc: torch.Tensor               # [T] on the device
    graph: GraphShape | None = None

    @property
    def wrapper(self) -> Any:
        """The first window's wrapper (all of them plan the same layout)."""
        return next(iter(self.wrappers.values()))


def window_left(window: int | None) -> int:
    """flashinfer's ``window_left`` for a window of ``window`` keys: keys p - window_left
    .. p are seen (-1: all)."""
    return -1 if window is None else window - 1


@frozen
class GraphBuffers:
    """The static layout every graph wrapper plans into (one set: graphs replay in order)."""

    qo_indptr: torch.Tensor       # [rows + 1] (prefill graphs)
    indptr: torch.Tensor          # [rows + 1]
    indices: torch.Tensor         # [pages]
    last_page_len: torch.Tensor   # [rows]


class FlashInferBackend:
    """Plans one wrapper per batch (prefill for prefill and mixed batches, decode for
    decode) and runs it for every layer; each CUDA graph has a graph-mode wrapper over the
    shared ``GraphBuffers``. Invariant: planning never blocks on the batch in flight."""

    capturable: ClassVar[bool] = True

    def __init__(self, spec: AttentionSpec) -> None:
        flashinfer = load_flashinfer(spec.device)
        self.fi, self.pool, self.device, self.dtype = flashinfer, spec.pool, spec.device, spec.dtype
        # What the pages hold: the model's dtype or FP8 (unscaled).
        self.kv_dtype = spec.pool.k.dtype
        self.page_table, self.page_size = spec.page_table, spec.pool.page_size
        self.pad_page = spec.pad_page
        self.num_heads, self.num_kv_heads = spec.num_heads, spec.num_kv_heads
        self.head_dim, self.scale = spec.head_dim, spec.scale
        self.windows, self.positions = spec.planned_windows(), spec.page_table.shape[1]
        self.decode_tensor_cores = _decode_tensor_cores(self.num_heads // self.num_kv_heads,
                                                        self.device)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        # One wrapper per window: a plan fixes its window_left. Runs are in stream order,
        # so the wrappers share the float workspace.
        self.prefill = {w: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend="fa2") for w in self.windows}
        # Decode over e4m3 pages takes XQA where it runs (its own workspace: the head of
        # it holds semaphores that other kernels must not write).
        self.xqa = decodes_with_xqa(flashinfer, self.device, self.kv_dtype, self.dtype,
                                    self.page_size, self.head_dim)
        self._xqa_workspace = (torch.zeros(XQA_WORKSPACE_BYTES, dtype=torch.uint8,
                                           device=self.device) if self.xqa else None)
        self.decode = {w: self._decode_wrapper(w) for w in self.windows}
        self._plan_events: dict[int, torch.cuda.Event] = {}
        pool = spec.pool
        shape = (pool.num_pages, pool.page_size, self.num_kv_heads, self.head_dim)
        self._pages = [(pool.k[i].view(shape), pool.v[i].view(shape))
                       for i in range(pool.k.shape[0])]
        self._graph_buffers: GraphBuffers | None = None
        self._graph_workspace = self.workspace

    @classmethod
    def check(cls, device: torch.device, dtype: torch.dtype) -> None:
        """flashinfer must be importable, for a CUDA device, with kernels for ``dtype``."""
        flashinfer = load_flashinfer(device)
        if dtype == torch.float32 and not getattr(flashinfer, "HAS_FLOAT32_KERNELS", False):
            raise ConfigError("flashinfer has no float32 kernels (its dtype maps hold fp16, "
                              "bf16 and fp8); use bfloat16 or float16, or "
                              "attention_backend='torch' for float32")

    def _decode_wrapper(self, window: int | None, rows: int | None = None,
                        buffers: GraphBuffers | None = None) -> Any:
        """A decode wrapper for ``window``: XQA's, or flashinfer's (in graph mode on
        ``buffers`` for a graph of ``rows`` rows)."""
        if self.xqa:
            assert self._xqa_workspace is not None
            return XqaDecode(self.fi, self._xqa_workspace, self.page_size,
                             -(-self.positions // self.page_size), self.scale,
                             window_left(window), self.device, rows=rows)
        if buffers is None:
            return self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=self.decode_tensor_cores)
        assert rows is not None
        return self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True,
            use_tensor_cores=self.decode_tensor_cores,
            paged_kv_indptr_buffer=buffers.indptr[: rows + 1],
            paged_kv_indices_buffer=buffers.indices,
            paged_kv_last_page_len_buffer=buffers.last_page_len[:rows])

    def plan(self, batch: Batch, out_loc: torch.Tensor) -> FlashInferMetadata:
        """Plan the decode wrapper for a decode batch, the prefill wrapper for any other."""
        if batch.phase == "decode" and self.xqa:
            self._plan_xqa(self.decode, batch.rows, batch.ends)
            return FlashInferMetadata(self.decode, out_loc)
        layout = self._staged(paged_layout(self.page_table, batch.rows, batch.ends,
                                           self.page_size))
        if batch.phase == "decode":
            for window, wrapper in self.decode.items():
                self._plan_decode(wrapper, layout, window)
            return FlashInferMetadata(self.decode, out_loc)
        qo_lens = np.asarray(batch.extend_lens, np.int64)
        for window, wrapper in self.prefill.items():
            self._plan_prefill(wrapper, qo_lens, layout, window)
        return FlashInferMetadata(self.prefill, out_loc)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: FlashInferMetadata, window: int | None = None) -> torch.Tensor:
        """Attend over each request's pages (the new K, V are already in them), through
        the wrapper planned with this layer's window."""
        wrapper = meta.wrappers[full_if_wider(window, self.positions)]
        out = wrapper.run(q.contiguous(), self._pages[layer])
        return out.view(q.shape[0], -1)

    def init_graph_state(self, shapes: Sequence[GraphShape]) -> None:
        """The layout buffers of all graphs and the prefill graphs' float workspace."""
        assert self.pad_page is not None, "graphs need a page for their padding rows"
        rows = max(shape.rows for shape in shapes)
        tokens = max(shape.tokens for shape in shapes)
        max_pages = (rows * (self.page_table.shape[1] // self.page_size + 1)
                     + -(-tokens // self.page_size))
        self._graph_buffers = GraphBuffers(
            torch.zeros(rows + 1, dtype=torch.int32, device=self.device),
            torch.zeros(rows + 1, dtype=torch.int32, device=self.device),
            torch.zeros(max_pages, dtype=torch.int32, device=self.device),
            torch.ones(rows, dtype=torch.int32, device=self.device))
        num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                   if self.device.type == "cuda" else 0)
        need = max((prefill_graph_workspace_bytes(shape, self.num_heads, self.num_kv_heads,
                                                  self.head_dim, num_sms)
                    for shape in shapes if shape.phase == "prefill"), default=0)
        if need > self.workspace.numel():
            self._graph_workspace = torch.zeros(need, dtype=torch.uint8, device=self.device)

    def graph_metadata(self, shape: GraphShape, out_loc: torch.Tensor) -> FlashInferMetadata:
        """A graph-mode wrapper for ``shape`` on the shared layout buffers."""
        buffers = self._graph_buffers
        assert buffers is not None, "init_graph_state first"
        return FlashInferMetadata({w: self._graph_wrapper(shape, buffers, w)
                                   for w in self.windows}, out_loc, shape)

    def _graph_wrapper(self, shape: GraphShape, buffers: GraphBuffers,
                       window: int | None) -> Any:
        if shape.phase == "decode":
            return self._decode_wrapper(window, shape.rows, buffers)
        return self.fi.BatchPrefillWithPagedKVCacheWrapper(
            self._graph_workspace, "NHD", use_cuda_graph=True,
            qo_indptr_buf=buffers.qo_indptr[: shape.rows + 1],
            paged_kv_indptr_buf=buffers.indptr[: shape.rows + 1],
            paged_kv_indices_buf=buffers.indices,
            paged_kv_last_page_len_buf=buffers.last_page_len[: shape.rows],
            backend="fa2")

    def prepare_replay(self, meta: FlashInferMetadata, rows: Sequence[int],
                       starts: Sequence[int], ends: Sequence[int]) -> None:
        """Plan the graph's wrapper for the batch, padded to the graph's shape."""
        shape = meta.graph
        assert shape is not None and self.pad_page is not None
        spare = shape.rows - len(rows)
        if shape.phase == "decode" and self.xqa:
            self._plan_xqa(meta.wrappers, rows, ends, spare)
            return
        if shape.phase == "decode":
            layout = self._staged(paged_layout(
                self.page_table, rows, ends, self.page_size, pad_lens=[1] * spare,
                pad_page=self.pad_page))
            for window, wrapper in meta.wrappers.items():
                self._plan_decode(wrapper, layout, window)
            return
        extend = np.subtract(ends, starts, dtype=np.int64)
        padding = shape.tokens - int(extend.sum())
        qo_lens = np.concatenate([extend, np.zeros(spare - 1, np.int64), [padding]])
        layout = self._staged(paged_layout(
            self.page_table, rows, ends, self.page_size,
            pad_lens=[1] * (spare - 1) + [max(padding, 1)], pad_page=self.pad_page))
        for window, wrapper in meta.wrappers.items():
            self._plan_prefill(wrapper, qo_lens, layout, window)

    def _plan_xqa(self, wrappers: dict[int | None, Any], rows: Sequence[int],
                  ends: Sequence[int], spare: int = 0) -> None:
        """XQA's block tables and lengths for the batch, ``spare`` padding rows of one
        token on the pad page after it; every window's wrapper takes the same."""
        assert not spare or self.pad_page is not None, "padding rows need the pad page"
        tables = block_tables(self.page_table, rows, self.page_size, spare,
                              self.pad_page or 0)
        lens = torch.tensor([*ends, *([1] * spare)], dtype=torch.int32)
        for wrapper in wrappers.values():
            wrapper.plan(tables, lens)

    def _staged(self, layout: PagedLayout) -> PagedLayout:
        return PagedLayout(pin(layout.indptr, self.device), upload(layout.indices, self.device),
                           pin(layout.last_page_len, self.device),
                           pin(layout.seq_lens, self.device))

    def _plan_prefill(self, wrapper: Any, qo_lens: np.ndarray, layout: PagedLayout,
                      window: int | None) -> None:
        qo_indptr = np.zeros(len(qo_lens) + 1, np.int32)
        np.cumsum(qo_lens, out=qo_indptr[1:])
        offsets = pin(torch.from_numpy(qo_indptr), self.device)
        self._plan(wrapper, lambda: wrapper.plan(
            host_lengths(offsets), layout.indptr, layout.indices, layout.last_page_len,
            self.num_heads, self.num_kv_heads, self.head_dim, self.page_size,
            causal=True, window_left=window_left(window), sm_scale=self.scale,
            q_data_type=self.dtype,
            kv_data_type=self.kv_dtype, seq_lens=host_lengths(layout.seq_lens)))

    def _plan_decode(self, wrapper: Any, layout: PagedLayout, window: int | None) -> None:
        self._plan(wrapper, lambda: wrapper.plan(
            layout.indptr, layout.indices, layout.last_page_len, self.num_heads,
            self.num_kv_heads, self.head_dim, self.page_size,
            window_left=window_left(window), q_data_type=self.dtype,
            kv_data_type=self.kv_dtype, sm_scale=self.scale,
            seq_lens=host_lengths(layout.seq_lens)))

    def _plan(self, wrapper: Any, plan: Any) -> None:
        # The wrapper's pinned staging buffer must not be rewritten before its last upload ran.
        previous = self._plan_events.get(id(wrapper))
        if previous is not None:
            previous.synchronize()
        plan()
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._plan_events[id(wrapper)] = event
