"""Decode over an e4m3 cache through flashinfer's XQA kernel (TensorRT-LLM's decode
kernel), which reads FP8 pages at near the rate it reads bf16 ones: flashinfer's decode
wrappers read them no faster than bf16. See docs/architecture.md, 'FP8 KV cache'."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType

import numpy as np
import torch

from asyncinfer.attention.host_to_device import pin, upload

XQA_PAGE_SIZES = (16, 32, 64, 128)   # the page sizes its kernels are built for
XQA_QUERY_DTYPES = (torch.bfloat16, torch.float16)
SEMAPHORE_BYTES = 8 * 2**20          # the head of its workspace: semaphores, kept zeroed
XQA_WORKSPACE_BYTES = SEMAPHORE_BYTES + 128 * 2**20


def xqa_kernel(fi: ModuleType) -> Callable[..., torch.Tensor] | None:
    """flashinfer's XQA decode entry point, where this flashinfer has one."""
    fn = getattr(fi, "xqa_batch_decode_with_kv_cache", None)
    if fn is None:
        fn = getattr(getattr(fi, "decode", None), "xqa_batch_decode_with_kv_cache", None)
    return fn


def supported_device(device: torch.device) -> bool:
    """XQA runs on SM 9.0 (Hopper), 10.x and 12.x GPUs."""
    return (device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] in (9, 10, 12))


def decodes_with_xqa(fi: ModuleType, device: torch.device, kv_dtype: torch.dtype,
                     q_dtype: torch.dtype, page_size: int, head_dim: int) -> bool:
    """Whether decode batches over a pool of ``kv_dtype`` take XQA here: e4m3 pages of a
    page size and head size its kernels are built for, half-precision queries."""
    return (kv_dtype == torch.float8_e4m3fn and page_size in XQA_PAGE_SIZES
            and q_dtype in XQA_QUERY_DTYPES and head_dim % 16 == 0 and 16 <= head_dim <= 256
            and xqa_kernel(fi) is not None and supported_device(device))


def block_tables(page_table: torch.Tensor, rows: Sequence[int], page_size: int,
                 pad_rows: int = 0, pad_page: int = 0) -> torch.Tensor:
    """[rows + pad_rows, pages per row] int32 (host): each row's page ids, every page of its
    table width (XQA reads those within its length); padding rows on ``pad_page``."""
    pages = page_table.numpy()[:, ::page_size][np.asarray(rows, np.int64)] // page_size
    if pad_rows:
        pages = np.concatenate([pages, np.full((pad_rows, pages.shape[1]), pad_page,
                                               pages.dtype)])
    return torch.from_numpy(pages.astype(np.int32))


class XqaDecode:
    """Stands where a flashinfer decode wrapper stands for one window: ``plan`` takes the
    batch's block tables and lengths, ``run`` attends. With ``rows`` (a CUDA graph) the
    tables live in static buffers of that many rows, refilled before each replay."""

    def __init__(self, fi: ModuleType, workspace: torch.Tensor, page_size: int,
                 table_pages: int, scale: float, window_left: int, device: torch.device,
                 rows: int | None = None) -> None:
        kernel = xqa_kernel(fi)
        assert kernel is not None, "decodes_with_xqa first"
        self.kernel, self.workspace, self.device = kernel, workspace, device
        self.max_seq_len = table_pages * page_size
        self.bmm1_scale = scale   # the pages are unscaled: nothing else to fold in
        self.window_left = window_left
        self.static = rows is not None
        self.block_tables = torch.zeros(rows or 0, table_pages, dtype=torch.int32,
                                        device=device)
        self.seq_lens = torch.ones(rows or 0, dtype=torch.int32, device=device)

    def plan(self, tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Upload the batch's tables and lengths (host int32) without blocking."""
        if self.static:
            n = tables.shape[0]
            self.block_tables[:n].copy_(pin(tables, self.device), non_blocking=True)
            self.seq_lens[:n].copy_(pin(seq_lens, self.device), non_blocking=True)
        else:
            self.block_tables = upload(tables, self.device)
            self.seq_lens = upload(seq_lens, self.device)

    def run(self, q: torch.Tensor, pages: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Attention of each row's one query over its pages ([rows, heads, dim] in q's
        dtype)."""
        return self.kernel(q, pages, self.workspace, self.block_tables, self.seq_lens,
                           self.max_seq_len, bmm1_scale=self.bmm1_scale, bmm2_scale=1.0,
                           window_left=self.window_left)
