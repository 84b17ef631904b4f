"""Host buffers in huge pages (asyncinfer.memory): the KV pool and the AMX-packed weights."""

from __future__ import annotations

import itertools
import os
import sys

import pytest
import torch

from asyncinfer.memory import HUGE_PAGE, Slab, empty_huge

THP = sys.platform.startswith("linux") and os.path.isdir("/sys/kernel/mm/transparent_hugepage")
"""Whether this kernel has transparent huge pages (madvise may ask for them)."""


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    flags: list[str] | None = None
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    assert flags is not None, "no mapping holds the address"
    return flags


def test_a_big_buffer_starts_on_a_huge_page_and_is_asked_to_be_huge() -> None:
    t = empty_huge((3, HUGE_PAGE // 2 + 5), torch.bfloat16)
    assert t.shape == (3, HUGE_PAGE // 2 + 5) and t.dtype == torch.bfloat16
    assert t.is_contiguous() and t.data_ptr() % HUGE_PAGE == 0
    t.fill_(1.5)
    assert bool((t == 1.5).all())
    if THP:
        assert "hg" in _vm_flags(t.data_ptr())  # MADV_HUGEPAGE took


def test_a_small_buffer_is_a_plain_tensor() -> None:
    t = empty_huge(100, torch.float32)
    assert t.shape == (100,) and t.dtype == torch.float32 and t.is_contiguous()


def test_a_slab_hands_out_aligned_disjoint_slices_until_it_is_used_up() -> None:
    sizes = [(1000, torch.bfloat16), (3, torch.float32), (HUGE_PAGE, torch.bfloat16)]
    slab = Slab(sizes)
    parts = [slab.take(n, dtype) for n, dtype in sizes]
    for part, (n, dtype) in zip(parts, sizes):
        assert part.numel() == n and part.dtype == dtype and part.data_ptr() % 64 == 0
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in parts)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    for i, part in enumerate(parts):
        part.fill_(i)
    assert [float(p.float().mean()) for p in parts] == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="slab exhausted"):
        slab.take(1, torch.bfloat16)


@pytest.mark.skipif(not THP, reason="no transparent huge pages here")
def test_the_cpu_kv_pool_is_zeroed_and_asked_for_huge_pages() -> None:
    from asyncinfer.kvcache.pool import KVPool

    pool = KVPool(2, 256, 16, 4, 64, torch.bfloat16, torch.device("cpu"))
    for cache in (pool.k, pool.v):
        assert cache.shape == (2, 4096, 4, 64) and not cache.any()
        assert "hg" in _vm_flags(cache.data_ptr())
