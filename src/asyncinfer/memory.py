"""Host buffers in 2 MiB pages, for the big tensors a CPU decode step reads end to end.

A decode step on a CPU streams the whole KV pool's live pages and every packed weight from
memory. In 4 KiB pages that is a TLB miss every 4 KiB, and under a hypervisor each miss
walks two page tables. Linux backs an anonymous mapping with 2 MiB pages where asked
(``madvise(MADV_HUGEPAGE)``; transparent huge pages in their default ``madvise`` mode), and
a buffer asked before its first touch gets them as it is written. The AMX products of one
step read their weights about a tenth faster from such pages.

Where the system gives no huge pages (another OS, THP off, ``madvise`` refused), these are
plain tensors: nothing else changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import sys

import torch

HUGE_PAGE = 2 << 20
"""Bytes in one huge page (x86-64's and arm64's usual 2 MiB)."""

_MADV_HUGEPAGE = 14
_ALIGN = 64  # bytes: a cache line, and what the CPU kernels' vector loads want


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def empty_huge(shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor whose memory is asked to be 2 MiB pages (its
    whole huge pages: a buffer under one huge page is a plain tensor). Write it before
    reading: the pages are made as it is first written."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise()
    if nbytes < HUGE_PAGE or madvise is None:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    # A refusal (THP off, an old kernel) leaves ordinary pages: nothing to report.
    madvise(raw.data_ptr() + start, nbytes // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)
    return raw[start:start + nbytes].view(dtype).view(shape)


class Slab:
    """One huge-page buffer of a size known in advance, handed out front to back in slices
    aligned to 64 bytes: many tensors of under 2 MiB each (a model's packed weights) in
    huge pages together. The buffer lives as long as any slice of it."""

    def __init__(self, sizes: list[tuple[int, torch.dtype]]) -> None:
        self._buf = empty_huge(sum(self._padded(n, d) for n, d in sizes), torch.uint8)
        self._at = 0

    @staticmethod
    def _padded(numel: int, dtype: torch.dtype) -> int:
        return -(-numel * dtype.itemsize // _ALIGN) * _ALIGN

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The next ``numel`` elements of ``dtype``, uninitialized."""
        size = self._padded(numel, dtype)
        if self._at + size > self._buf.numel():
            raise ValueError(f"slab exhausted: {size} bytes asked, "
                             f"{self._buf.numel() - self._at} left")
        part = self._buf[self._at:self._at + numel * dtype.itemsize].view(dtype)
        self._at += size
        return part
