"""A CPU stand-in for flashinfer's two paged-attention wrappers, written from their documented
contract: int32 ``indptr``/``indices``/``last_page_len``, NHD pages, causal queries aligned to
the end of each request's KV, a sliding window by ``window_left`` (a query at position p
sees keys p - window_left .. p; -1: all), and (CUDA-graph mode) plans copied into the
caller's buffers and read back at run time, with flashinfer's graph-mode rules for prefill
(prefill.py, ``plan`` and ``run``): a fixed batch size, no more query rows than the first
plan had, queries exactly ``qo_indptr[-1]``. Requests with no query row are allowed (a
graph's padding). It lets the runner's flashinfer path (metadata, padding, graph buffers)
run in the CPU suite; the real kernels are checked on the GPU (tests/gpu).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

HAS_FLOAT32_KERNELS = True   # the stand-in computes in float32; the real flashinfer does not


class _PagedWrapper:
    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None,
                 backend: str = "auto") -> None:
        assert kv_layout == "NHD"
        self.graph = use_cuda_graph
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                        paged_kv_last_page_len_buffer)
        self.qo_indptr: torch.Tensor | None = None
        self.qo_indptr_buf: torch.Tensor | None = None
        self.planned: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.plans = 0
        self.window_left = -1   # as the last plan set it

    def _store(self, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor,
               page_size: int) -> None:
        for t in (indptr, indices, last):
            assert t.dtype == torch.int32, t.dtype
        assert int(last.min()) >= 1 and int(last.max()) <= page_size, last
        self.page_size = page_size
        self.plans += 1
        if self.graph:  # like flashinfer: copy into the fixed buffers, read them at run time
            indptr_buf, indices_buf, last_buf = self.buffers
            assert indptr_buf is not None and indices_buf is not None and last_buf is not None
            assert indptr.numel() == indptr_buf.numel(), "graph batch size is fixed"
            indptr_buf.copy_(indptr)
            last_buf.copy_(last)
            indices_buf[: indices.numel()].copy_(indices)
        else:
            self.planned = (indptr.clone(), indices.clone(), last.clone())

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor],
            k_scale: float | None = None, v_scale: float | None = None) -> torch.Tensor:
        k_pages, v_pages = paged_kv_cache
        # flashinfer compiles a kernel for the planned dtypes: pages of another dtype fail.
        assert k_pages.dtype == v_pages.dtype == self.kv_data_type, (k_pages.dtype,
                                                                     self.kv_data_type)
        assert q.dtype == self.q_data_type, (q.dtype, self.q_data_type)
        if self.graph:
            indptr, indices, last = self.buffers  # type: ignore[assignment]
        else:
            assert self.planned is not None, "run before plan"
            indptr, indices, last = self.planned
        batch = last.numel()
        if self.qo_indptr_buf is not None:  # graph mode: read back like the buffers
            qo = self.qo_indptr_buf
        else:
            qo = self.qo_indptr if self.qo_indptr is not None else torch.arange(batch + 1)
        assert q.shape[0] == int(qo[-1]), "q must have qo_indptr[-1] rows"
        out = torch.empty_like(q)
        for i in range(batch):
            pages = indices[int(indptr[i]) : int(indptr[i + 1])].long()
            kv_len = (pages.numel() - 1) * self.page_size + int(last[i])
            keys = k_pages[pages].flatten(0, 1)[:kv_len].float() * (k_scale or 1.0)
            values = v_pages[pages].flatten(0, 1)[:kv_len].float() * (v_scale or 1.0)
            lo, hi = int(qo[i]), int(qo[i + 1])
            if hi == lo:  # a request with no query row
                continue
            qr = q[lo:hi].float()
            n = hi - lo
            group = q.shape[1] // keys.shape[1]
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
            # Query j sits at position kv_len - n + j and sees keys up to it (with a window,
            # from window_left before it).
            ones = torch.ones(n, kv_len, dtype=torch.bool)
            mask = ones.tril(diagonal=kv_len - n)
            if self.window_left >= 0:
                mask &= ~ones.tril(diagonal=kv_len - n - self.window_left - 1)
            res = F.scaled_dot_product_attention(
                qr.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=mask, scale=self.sm_scale)
            out[lo:hi] = res.transpose(0, 1).to(q.dtype)
        return out


class BatchDecodeWithPagedKVCacheWrapper(_PagedWrapper):
    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             **options: Any) -> None:
        self.sm_scale = options.get("sm_scale") or head_dim**-0.5
        self.window_left = int(options.get("window_left", -1))
        self.q_data_type, self.kv_data_type = options["q_data_type"], options["kv_data_type"]
        self._store(indptr, indices, last_page_len, page_size)
        _check_lengths(options.get("seq_lens"), indptr, last_page_len, page_size)


def _check_lengths(seq_lens: torch.Tensor | None, indptr: torch.Tensor,
                   last_page_len: torch.Tensor, page_size: int) -> None:
    """The KV lengths handed to plan agree with the paged layout, and survive what flashinfer
    does with them on the host: ``max(seq_lens.cpu()).item()`` (decode.py, prefill.py)."""
    assert seq_lens is not None, "plan needs seq_lens (flashinfer recomputes them otherwise)"
    expected = (indptr[1:] - indptr[:-1] - 1) * page_size + last_page_len
    assert torch.equal(seq_lens.cpu().flatten().long(), expected.long())
    assert max(seq_lens.cpu()).item() == int(expected.max())


class BatchPrefillWithPagedKVCacheWrapper(_PagedWrapper):
    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indices_buf: torch.Tensor | None = None,
                 paged_kv_last_page_len_buf: torch.Tensor | None = None,
                 backend: str = "auto") -> None:
        super().__init__(workspace, kv_layout, use_cuda_graph,
                         paged_kv_indptr_buffer=paged_kv_indptr_buf,
                         paged_kv_indices_buffer=paged_kv_indices_buf,
                         paged_kv_last_page_len_buffer=paged_kv_last_page_len_buf)
        if use_cuda_graph:
            assert qo_indptr_buf is not None and paged_kv_indptr_buf is not None
            assert paged_kv_last_page_len_buf is not None
            assert qo_indptr_buf.numel() == paged_kv_indptr_buf.numel()
            assert paged_kv_last_page_len_buf.numel() == qo_indptr_buf.numel() - 1
        self.qo_indptr_buf = qo_indptr_buf
        self.max_total_num_rows: int | None = None

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor,
             paged_kv_indices: torch.Tensor, paged_kv_last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int,
             **options: Any) -> None:
        assert options.get("causal") is True
        assert qo_indptr.dtype == torch.int32
        self.sm_scale = options.get("sm_scale") or head_dim_qk**-0.5
        self.window_left = int(options.get("window_left", -1))
        self.q_data_type, self.kv_data_type = options["q_data_type"], options["kv_data_type"]
        self.qo_indptr = qo_indptr.clone()
        if self.graph:  # flashinfer's graph-mode rules (prefill.py, plan)
            assert self.qo_indptr_buf is not None
            total = int(qo_indptr[-1])
            if self.max_total_num_rows is None:
                self.max_total_num_rows = total
            assert total <= self.max_total_num_rows, "more rows than the first plan had"
            self.qo_indptr_buf.copy_(qo_indptr)
        self._store(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size)
        _check_lengths(options.get("seq_lens"), paged_kv_indptr, paged_kv_last_page_len,
                       page_size)
        # flashinfer's own host arithmetic on the query offsets (prefill.py)
        host = qo_indptr.to("cpu")
        assert max(host[1:] - host[:-1]).item() == int((host[1:] - host[:-1]).max())


def xqa_batch_decode_with_kv_cache(
        query: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
        workspace_buffer: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
        max_seq_len: int, bmm1_scale: float = 1.0, bmm2_scale: float = 1.0,
        window_left: int = -1, **options: Any) -> torch.Tensor:
    """flashinfer's XQA decode (decode.py): one query per row over the pages its row of
    ``block_tables`` lists, ``seq_lens[i]`` keys long; logits scaled by ``bmm1_scale``,
    the output by ``bmm2_scale``. Its SM90 kernels take e4m3 pages, int32 tables of a
    width (which sets the longest length, whatever ``max_seq_len`` says), and its
    workspace's head as zeroed semaphores."""
    k_pages, v_pages = kv_cache
    assert k_pages.dtype == v_pages.dtype == torch.float8_e4m3fn, k_pages.dtype
    assert block_tables.dtype == seq_lens.dtype == torch.int32
    assert query.dim() == 3 and block_tables.shape[0] == seq_lens.shape[0] == query.shape[0]
    page_size = k_pages.shape[1]
    assert int(seq_lens.min()) >= 1 and int(seq_lens.max()) <= block_tables.shape[1] * page_size
    assert workspace_buffer.dtype == torch.uint8 and workspace_buffer.numel() > 8 * 2**20
    out = torch.empty_like(query)
    group = query.shape[1] // k_pages.shape[2]
    for i in range(query.shape[0]):
        n = int(seq_lens[i])
        pages = block_tables[i, : -(-n // page_size)].long()
        keys = k_pages[pages].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        values = v_pages[pages].flatten(0, 1)[:n].float().repeat_interleave(group, dim=1)
        if window_left >= 0:  # the query at position n - 1 sees n - 1 - window_left ..
            keys, values = keys[max(0, n - 1 - window_left):], values[max(0, n - 1 - window_left):]
        logits = torch.einsum("hd,nhd->hn", query[i].float(), keys) * bmm1_scale
        out[i] = (torch.einsum("hn,nhd->hd", logits.softmax(-1), values)
                  * bmm2_scale).to(query.dtype)
    return out
