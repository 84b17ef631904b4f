"""Host buffers in 2 MiB pages where the system allows (docs/architecture.md, 'Huge pages')."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import os
import sys

import torch

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's usual huge page

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


def return_free_heap() -> None:
    """Hand the C heap's free memory back to the system (glibc): loading weights leaves
    freed copies there that would otherwise stay resident for the process's life."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def empty_huge(shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor whose whole 2 MiB pages are asked to be huge pages (made
    as it is first written)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise()
    if nbytes < HUGE_PAGE or madvise is None:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    madvise(raw.data_ptr() + start, nbytes // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)
    return raw[start:start + nbytes].view(dtype).view(shape)


def zeros_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in fresh anonymous memory (huge pages asked for), which the kernel
    commits page by page as it is first written: an idle KV pool holds no memory."""
    nbytes = math.prod(shape) * dtype.itemsize
    buf = mmap.mmap(-1, max(1, nbytes + HUGE_PAGE))  # anonymous: zero-filled, lazily backed
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # holds ``buf`` as long as it lives
    start = -raw.data_ptr() % HUGE_PAGE
    madvise = _madvise()
    if madvise is not None and nbytes >= HUGE_PAGE:
        madvise(raw.data_ptr() + start, nbytes // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)
    return raw[start:start + nbytes].view(dtype).view(shape)


def available_memory() -> int | None:
    """Bytes this process may still take: the system's MemAvailable, less where a cgroup's
    limit leaves less; None where neither is known."""
    known: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            line = next((line for line in f if line.startswith("MemAvailable:")), None)
        if line is not None:
            known.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    try:  # cgroup v2: this process's group, its limit and its use
        with open("/proc/self/cgroup") as f:
            group = next(line for line in f if line.startswith("0::")).strip()[3:]
        root = os.path.join("/sys/fs/cgroup", group.lstrip("/"))
        with open(os.path.join(root, "memory.max")) as f:
            limit = f.read().strip()
        if limit != "max":
            with open(os.path.join(root, "memory.current")) as f:
                known.append(max(0, int(limit) - int(f.read())))
    except (OSError, StopIteration, ValueError):
        pass
    return min(known) if known else None


class Slab:
    """One huge-page buffer handed out front to back in 64-byte aligned slices (small packed
    weights in huge pages together); it lives as long as any slice of it."""

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
