"""The naive cache: each request owns the pages of its own tokens; nothing is shared."""

from __future__ import annotations

import torch

from asyncinfer.kvcache.pool import PageAllocator


class NaiveCache:
    """Allocates pages per table row as its sequence grows, and frees them all at the end."""

    def __init__(self, allocator: PageAllocator, page_table: torch.Tensor, page_size: int) -> None:
        self.allocator = allocator
        self.page_table = page_table
        self.page_size = page_size
        self.pages: dict[int, list[int]] = {}

    def pages_needed(self, row: int, end: int) -> int:
        """New pages ``row`` would need to hold positions ``[0, end)``."""
        have = len(self.pages.get(row, ()))
        return max(0, -(-end // self.page_size) - have)

    def reserve(self, row: int, end: int) -> None:
        """Make positions ``[0, end)`` of ``row`` map to KV slots of pages it owns."""
        owned = self.pages.setdefault(row, [])
        new = self.allocator.allocate(self.pages_needed(row, end))
        if not new:
            return
        first = len(owned) * self.page_size
        owned.extend(new)
        slots = torch.tensor(new, dtype=torch.int64)[:, None] * self.page_size
        slots = (slots + torch.arange(self.page_size)).flatten()
        self.page_table[row, first : first + slots.numel()] = slots.to(self.page_table.device)

    def release(self, row: int) -> None:
        """Return every page of ``row``."""
        self.allocator.free(self.pages.pop(row, []))
