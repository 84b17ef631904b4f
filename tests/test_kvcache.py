"""Pages are conserved, owned by one row at a time, and mapped slot by slot in the table."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncinfer.kvcache.naive import NaiveCache
from asyncinfer.kvcache.pool import PageAllocator


@settings(max_examples=60, deadline=None)
@given(page_size=st.sampled_from([1, 4, 16]),
       ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 60), st.booleans()),
                    max_size=40))
def test_naive_cache_conserves_pages_and_maps_owned_slots(
    page_size: int, ops: list[tuple[int, int, bool]]
) -> None:
    num_pages = 64
    allocator = PageAllocator(num_pages)
    table = torch.full((4, 64), -1, dtype=torch.int64)
    cache = NaiveCache(allocator, table, page_size)
    lengths = dict.fromkeys(range(4), 0)
    for row, grow, release in ops:
        if release:
            cache.release(row)
            lengths[row] = 0
            continue
        end = min(64, lengths[row] + grow)
        if cache.pages_needed(row, end) > allocator.num_free:
            continue
        cache.reserve(row, end)
        lengths[row] = max(lengths[row], end)
        used = sum(len(p) for p in cache.pages.values())
        assert allocator.num_free + used == num_pages
        owned = [p for pages in cache.pages.values() for p in pages]
        assert len(owned) == len(set(owned)), "a page has two owners"
        slots = table[row, : lengths[row]]
        assert set((slots // page_size).tolist()) <= set(cache.pages[row])
        assert len(set(slots.tolist())) == lengths[row]
    for row in range(4):
        cache.release(row)
    assert allocator.num_free == num_pages


def test_allocation_order_is_deterministic() -> None:
    a, b = PageAllocator(8), PageAllocator(8)
    for alloc in (a, b):
        first = alloc.allocate(3)
        alloc.allocate(2)
        alloc.free(first)
    assert a.allocate(5) == b.allocate(5) == [0, 1, 2, 5, 6]
