"""The page allocator hands out pages in an order every rank agrees on."""

from __future__ import annotations

from asyncinfer.kvcache.pool import PageAllocator


def test_allocation_order_is_deterministic() -> None:
    a, b = PageAllocator(8), PageAllocator(8)
    for alloc in (a, b):
        first = alloc.allocate(3)
        alloc.allocate(2)
        alloc.free(first)
    assert a.allocate(5) == b.allocate(5) == [0, 1, 2, 5, 6]
