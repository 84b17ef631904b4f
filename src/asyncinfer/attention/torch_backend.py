"""The reference attention backend: torch SDPA over K/V gathered from the page pool, on any
device and dtype; on a CPU, the compiled kernels' decode and AMX prefill attention where
they build (K and V read in place)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from attrs import define
from torch.nn import functional as F

from asyncinfer.attention.base import AttentionSpec, GraphShape, full_if_wider
from asyncinfer.attention.host_to_device import upload
from asyncinfer.core import Batch
from asyncinfer.errors import ConfigError
from asyncinfer.kernels import triton_invariant
from asyncinfer.kvcache.pool import is_fp8

if TYPE_CHECKING:
    from asyncinfer.kernels.cpu import NativeKernels


@define
class TorchMetadata:
    """Where new tokens go and which slots each request attends to."""

    out_loc: torch.Tensor                 # [T] KV slot of each computed token
    kv_slots: list[torch.Tensor]          # per request: slots of [0, end) (prefill only)
    q_bounds: list[tuple[int, int]]       # per request: its rows in the flat token axis
    starts: list[int]
    decode_groups: list[DecodeGroup]      # when every request decodes
    native: NativeDecode | None = None    # the leading decoding requests, with the CPU kernel
    prefill: NativePrefill | None = None  # prefill and mixed batches, with the CPU kernel


@define
class NativeDecode:
    """Queries for the CPU decode kernel: their requests' rows of the page table (copied:
    the scheduler edits the table while this batch runs), each query's row of it and
    length. A decode batch has one query per request; a batch-invariant one, one per new
    token."""

    table: torch.Tensor                   # [n, max_len] int64: KV slot of each position
    rows: torch.Tensor                    # [queries] int64: each query's row of ``table``
    lens: torch.Tensor                    # [queries] int64: positions 0 .. len attended
    max_len: int


@define
class NativePrefill:
    """A prefill or mixed batch for the CPU's AMX kernel: each request's slots of [0, end)
    in a row, with its offsets, cached length and new-token count."""

    slots: torch.Tensor                   # [sum of ends] int64
    slot_at: torch.Tensor                 # [n] int64
    q_at: torch.Tensor                    # [n] int64
    starts: torch.Tensor                  # [n] int64
    news: torch.Tensor                    # [n] int64


@define
class DecodeGroup:
    """Decoding requests of similar length, attended in one padded SDPA call."""

    index: torch.Tensor | None            # their rows in the batch (None: the whole batch)
    pages: torch.Tensor                   # [n * P] their pages, padded to the longest
    masks: dict[int | None, torch.Tensor]  # window -> [n, 1, 1, P * page_size]: key j seen


class TorchBackend:
    """Decode batches as padded SDPA calls over groups of similar length; prefill and mixed
    batches per request. Queries take the dtype attention computes in (the pool's; over FP8
    pages the queries' own, float32 on a CPU) and outputs come back narrowed. Not
    capturable: its shapes follow the requests' lengths."""

    capturable: ClassVar[bool] = False

    def __init__(self, spec: AttentionSpec) -> None:
        self.pool = spec.pool
        self.page_table = spec.page_table
        self.scale = spec.scale
        self.device = spec.device
        self.num_heads, self.head_dim = spec.num_heads, spec.head_dim
        self.positions = spec.page_table.shape[1]
        self.windows = spec.planned_windows()
        self.native: NativeKernels | None = None
        self.native_prefill = False
        self.invariant = spec.invariant
        # What attention computes in: the pool's dtype; over an FP8 pool (read back) the
        # queries' dtype, float32 on a CPU.
        self.fp8 = is_fp8(spec.pool.k.dtype)
        self.compute = spec.pool.k.dtype
        if self.fp8:
            self.compute = torch.float32 if spec.device.type == "cpu" else spec.dtype
        if spec.native and spec.device.type == "cpu":
            from asyncinfer.kernels.cpu import load

            kernels = load()
            if kernels is not None and kernels.supports(spec.pool.k.dtype):
                self.native = kernels
                self.native_prefill = kernels.runs_prefill(
                    spec.pool.k.dtype, spec.num_heads, spec.pool.k.shape[2], spec.head_dim)
        # What attends NativeDecode queries: the CPU kernel, else (batch-invariant) Triton's.
        self.decoder: DecodeAttention | None = self.native
        if self.invariant and self.native is None:
            self.decoder = _triton_attention(spec.device)

    @classmethod
    def check(cls, device: torch.device, dtype: torch.dtype) -> None:
        """Runs on any device and dtype."""

    def plan(self, batch: Batch, out_loc: torch.Tensor) -> TorchMetadata:
        """Look up slots in the host page table once; every layer reuses them."""
        bounds, offset = [], 0
        for n in batch.extend_lens:
            bounds.append((offset, offset + n))
            offset += n
        if self.invariant:
            return self._every_token(batch, out_loc, bounds)
        if batch.phase == "decode" and self.native is not None:
            ends = list(batch.ends)
            longest = max(ends)
            table = self.page_table[torch.tensor(batch.rows), :longest]
            return TorchMetadata(out_loc, [], bounds, list(batch.starts), [], NativeDecode(
                table, torch.arange(batch.size), torch.tensor(ends, dtype=torch.int64),
                longest))
        if batch.phase == "decode":  # the groups hold all the slots decode reads
            return TorchMetadata(out_loc, [], bounds, list(batch.starts),
                                 self._decode_groups(batch))
        # A mixed batch's decoding rows lead it: without the AMX prefill kernel, the CPU
        # decode kernel takes those (in place) and the rest go request by request.
        head = self._decoding_head(batch) if not self.native_prefill else 0
        native = None
        if head:
            longest = max(batch.ends[:head])
            native = NativeDecode(self.page_table[torch.tensor(batch.rows[:head]), :longest],
                                  torch.arange(head),
                                  torch.tensor(batch.ends[:head], dtype=torch.int64), longest)
        rows, ends = batch.rows[head:], list(batch.ends[head:])
        slots = upload(torch.cat([self.page_table[r, :e] for r, e in zip(rows, ends)]),
                       self.device)
        prefill = None
        if self.native_prefill:
            slot_at = list(itertools.accumulate(ends, initial=0))[:-1]
            prefill = NativePrefill(slots, torch.tensor(slot_at),
                                    torch.tensor([lo for lo, _ in bounds]),
                                    torch.tensor(list(batch.starts)),
                                    torch.tensor(list(batch.extend_lens)))
        return TorchMetadata(out_loc, list(slots.split(ends)), bounds[head:],
                             list(batch.starts[head:]), [], native=native, prefill=prefill)

    def _every_token(self, batch: Batch, out_loc: torch.Tensor,
                     bounds: list[tuple[int, int]]) -> TorchMetadata:
        """Each new token as one query of the decode kernel, at its own position: a query
        sums over its keys in the same order whether it decodes, sits in a prefill chunk or
        follows a cached prefix, and whatever else is in the batch."""
        ends = list(batch.ends)
        longest = max(ends)
        table = self.page_table[torch.tensor(batch.rows), :longest]
        news = torch.tensor(list(batch.extend_lens), dtype=torch.int64)
        rows = torch.repeat_interleave(torch.arange(batch.size), news)
        lens = torch.cat([torch.arange(s + 1, s + n + 1, dtype=torch.int64)
                          for s, n in zip(batch.starts, batch.extend_lens)])
        table, rows, lens = (upload(t, self.device) for t in (table, rows, lens))
        return TorchMetadata(out_loc, [], bounds, list(batch.starts), [],
                             NativeDecode(table, rows, lens, longest))

    def _decoding_head(self, batch: Batch) -> int:
        """How many leading requests compute one token each (0 without the decode kernel)."""
        if self.native is None:
            return 0
        head = 0
        for n in batch.extend_lens:
            if n != 1:
                break
            head += 1
        return head

    def _decode_groups(self, batch: Batch) -> list[DecodeGroup]:
        # Sorted by length, split into groups, each padded to its own longest.
        count = min(_MAX_GROUPS, -(-batch.size // _MIN_GROUP))
        if count == 1:
            return [self._group(None, batch.rows, batch.ends)]
        order = sorted(range(batch.size), key=lambda i: batch.ends[i])
        bounds = [round(g * batch.size / count) for g in range(count + 1)]
        groups = []
        for lo, hi in itertools.pairwise(bounds):
            members = order[lo:hi]
            index = upload(torch.tensor(members), self.device)
            groups.append(self._group(index, [batch.rows[i] for i in members],
                                      [batch.ends[i] for i in members]))
        return groups

    def _group(self, index: torch.Tensor | None, rows: list[int],
               ends: list[int]) -> DecodeGroup:
        size = self.pool.page_size
        width = -(-max(ends) // size) * size
        # Whole pages are gathered: one long copy each instead of one per token.
        pages = upload(self.page_table[torch.tensor(rows), :width:size] // size, self.device)
        lengths = upload(torch.tensor(ends), self.device)
        keys = torch.arange(width, device=self.device)[None, :]
        masks = {w: ((keys < lengths[:, None]) if w is None else
                     (keys < lengths[:, None]) & (keys >= lengths[:, None] - w))[:, None, None]
                 for w in self.windows}
        return DecodeGroup(index, pages.flatten(), masks)

    def init_graph_state(self, shapes: Sequence[GraphShape]) -> None:
        raise ConfigError(_NOT_CAPTURABLE)

    def graph_metadata(self, shape: GraphShape, out_loc: torch.Tensor) -> TorchMetadata:
        raise ConfigError(_NOT_CAPTURABLE)

    def prepare_replay(self, meta: TorchMetadata, rows: Sequence[int], starts: Sequence[int],
                       ends: Sequence[int]) -> None:
        raise ConfigError(_NOT_CAPTURABLE)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        meta: TorchMetadata, window: int | None = None,
    ) -> torch.Tensor:
        """Attend causally over each request's prefix, its last ``window`` keys where there is
        one (k, v are already in the pool)."""
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]
        out_dtype, dtype = q.dtype, self.compute
        window = full_if_wider(window, self.positions)
        if meta.native is not None:
            assert self.decoder is not None
            head = meta.native.rows.shape[0]
            out = self.decoder.decode_attention(
                q[:head], k_pool, v_pool, meta.native.table, meta.native.rows,
                meta.native.lens, self.scale, meta.native.max_len, window)
            out = out.view(head, -1).to(out_dtype)
            if not meta.kv_slots:  # a decode batch: nothing more
                return out
            return torch.cat([out, self._per_request(layer, q, k, v, meta, window).to(out_dtype)])
        if meta.prefill is not None:
            assert self.native is not None
            p = meta.prefill
            out = self.native.prefill_attention(q.to(dtype), k_pool, v_pool, p.slots,
                                                p.slot_at, p.q_at, p.starts, p.news,
                                                self.scale, window)
            return out.view(q.shape[0], -1).to(out_dtype)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if meta.decode_groups:
            out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
            for group in meta.decode_groups:
                qg = q if group.index is None else q.index_select(0, group.index)
                seen = group.masks[window]
                n, width = qg.shape[0], seen.shape[-1]
                shape = (n, width, *k_pool.shape[1:])
                keys = self._read(_gather_pages(k_pool, group.pages, self.pool.page_size)
                                  .view(shape))
                values = self._read(_gather_pages(v_pool, group.pages, self.pool.page_size)
                                    .view(shape))
                res = F.scaled_dot_product_attention(
                    qg.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                    attn_mask=seen, scale=self.scale, enable_gqa=True).reshape(n, -1)
                if group.index is None:
                    out = res
                else:
                    out.index_copy_(0, group.index, res)
            return out.to(out_dtype)
        return self._per_request(layer, q, k, v, meta, window).to(out_dtype)

    def _per_request(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     meta: TorchMetadata, window: int | None) -> torch.Tensor:
        """SDPA request by request over ``meta.q_bounds`` (in ``self.compute``)."""
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]
        dtype = self.compute
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        outs = []
        for (lo, hi), start, slots in zip(meta.q_bounds, meta.starts, meta.kv_slots):
            qr = q[lo:hi].transpose(0, 1).unsqueeze(0)             # [1, heads, n, dim]
            if start == 0 and not self.fp8:  # nothing cached: fresh k, v are all there is
                kr, vr = k[lo:hi], v[lo:hi]
            else:  # an FP8 pool is read back, as flashinfer reads it
                kr = self._read(k_pool.index_select(0, slots))
                vr = self._read(v_pool.index_select(0, slots))
            kr = kr.transpose(0, 1).unsqueeze(0)
            vr = vr.transpose(0, 1).unsqueeze(0)
            n, total = hi - lo, slots.numel()
            # Query i sits at position start + i and sees keys 0 .. start + i (with a
            # window: those past start + i - window).
            mask: torch.Tensor | None = None
            if start > 0 or (window is not None and start + n > window):
                ones = torch.ones(n, total, dtype=torch.bool, device=q.device)
                mask = ones.tril(diagonal=start)
                if window is not None:
                    mask &= ~ones.tril(diagonal=start - window)
            out = F.scaled_dot_product_attention(
                qr, kr, vr, attn_mask=mask, is_causal=mask is None and n > 1,
                scale=self.scale, enable_gqa=True)
            outs.append(out.squeeze(0).transpose(0, 1).reshape(n, -1))
        return torch.cat(outs) if len(outs) > 1 else outs[0]


    def _read(self, stored: torch.Tensor) -> torch.Tensor:
        """Keys or values of the pool in the dtype attention computes in."""
        return stored.to(self.compute) if self.fp8 else stored


class DecodeAttention(Protocol):
    """What attends NativeDecode queries (``NativeKernels.decode_attention``'s contract)."""

    def decode_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
                         scale: float, max_len: int, window: int | None = None
                         ) -> torch.Tensor: ...


class _TritonAttention:
    """The batch-invariant mode's attention off the CPU: ``decode_attention`` as the CPU
    kernels' (``kernels.triton_invariant``)."""

    def __init__(self) -> None:
        self.decode_attention = triton_invariant.decode_attention


def _triton_attention(device: torch.device) -> _TritonAttention:
    if not triton_invariant.available(device):
        raise ConfigError("batch_invariant needs the CPU decode-attention kernel (cpu_kernels "
                          "on, a C compiler, a bf16 or float32 cache) or, on CUDA, triton")
    return _TritonAttention()


_MAX_GROUPS = 4     # padded SDPA calls per decode layer at most
_MIN_GROUP = 8      # requests per group at least
_NOT_CAPTURABLE = ("the torch attention backend cannot be captured in CUDA graphs (its "
                   "decode shapes follow the batch's lengths)")


def _gather_pages(pool: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Rows of whole pages: ``pool`` viewed as [pages, page_size * rest], selected by id."""
    return pool.view(pool.shape[0] // page_size, -1).index_select(0, pages)
