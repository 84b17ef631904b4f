"""The reference attention backend: torch SDPA over K/V gathered from the page pool."""

from __future__ import annotations

import torch
from attrs import define
from torch.nn import functional as F

from asyncinfer.engine.batch import Batch
from asyncinfer.kvcache.pool import KVPool


@define
class TorchMetadata:
    """Where new tokens go and which slots each request attends to."""

    out_loc: torch.Tensor                 # [T] KV slot of each computed token
    kv_slots: list[torch.Tensor]          # per request: slots of positions [0, end)
    q_bounds: list[tuple[int, int]]       # per request: its rows in the flat token axis
    starts: list[int]
    decode_pages: torch.Tensor | None     # [B * P] pages of each request, padded, when decoding
    decode_mask: torch.Tensor | None      # [B, 1, 1, P * page_size] key j valid for request b


class TorchBackend:
    """Decode batches run as one padded SDPA call; prefill and mixed batches loop per request.

    The pool may hold a wider dtype than the model's activations (float32 kernels for
    half-precision values on CPU); queries are widened to match and outputs narrowed back.
    """

    def __init__(self, pool: KVPool, page_table: torch.Tensor, scale: float) -> None:
        self.pool = pool
        self.page_table = page_table
        self.scale = scale

    def prepare(
        self, batch: Batch, row_index: torch.Tensor, positions: torch.Tensor
    ) -> TorchMetadata:
        """Look up slots in the page table once; every layer reuses them."""
        out_loc = self.page_table[row_index, positions]
        kv_slots = [self.page_table[r, :e] for r, e in zip(batch.rows, batch.ends)]
        bounds, offset = [], 0
        for n in batch.extend_lens:
            bounds.append((offset, offset + n))
            offset += n
        pages = mask = None
        if batch.phase == "decode":
            device, size = out_loc.device, self.pool.page_size
            width = -(-max(batch.ends) // size) * size
            rows = torch.tensor(batch.rows, device=device)
            # Whole pages are gathered: one long copy each instead of one per token.
            pages = (self.page_table[rows, :width:size] // size).flatten()
            ends = torch.tensor(batch.ends, device=device)
            mask = (torch.arange(width, device=device)[None, :] < ends[:, None])[:, None, None]
        return TorchMetadata(out_loc, kv_slots, bounds, list(batch.starts), pages, mask)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        meta: TorchMetadata,
    ) -> torch.Tensor:
        """Store k, v at their slots, then attend causally over each request's whole prefix."""
        self.pool.store(layer, meta.out_loc, k, v)
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]
        out_dtype, dtype = q.dtype, k_pool.dtype
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if meta.decode_pages is not None:
            assert meta.decode_mask is not None
            b, width = q.shape[0], meta.decode_mask.shape[-1]
            shape = (b, width, *k_pool.shape[1:])
            keys = _gather_pages(k_pool, meta.decode_pages, self.pool.page_size).view(shape)
            values = _gather_pages(v_pool, meta.decode_pages, self.pool.page_size).view(shape)
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=True)
            return out.reshape(b, -1).to(out_dtype)
        outs = []
        for (lo, hi), start, slots in zip(meta.q_bounds, meta.starts, meta.kv_slots):
            qr = q[lo:hi].transpose(0, 1).unsqueeze(0)             # [1, heads, n, dim]
            if start == 0:  # nothing cached: the fresh k, v are the whole sequence
                kr, vr = k[lo:hi], v[lo:hi]
            else:
                kr, vr = k_pool.index_select(0, slots), v_pool.index_select(0, slots)
            kr = kr.transpose(0, 1).unsqueeze(0)
            vr = vr.transpose(0, 1).unsqueeze(0)
            n, total = hi - lo, slots.numel()
            # Query i sits at position start + i and sees keys 0 .. start + i.
            mask = None if start == 0 else torch.ones(
                n, total, dtype=torch.bool, device=q.device).tril(diagonal=start)
            out = F.scaled_dot_product_attention(
                qr, kr, vr, attn_mask=mask, is_causal=start == 0 and n > 1,
                scale=self.scale, enable_gqa=True)
            outs.append(out.squeeze(0).transpose(0, 1).reshape(n, -1))
        return (torch.cat(outs) if len(outs) > 1 else outs[0]).to(out_dtype)


def _gather_pages(pool: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Rows of whole pages: ``pool`` viewed as [pages, page_size * rest], selected by id."""
    return pool.view(pool.shape[0] // page_size, -1).index_select(0, pages)
