"""The cache manager: pages for requests, shared through the radix prefix cache or not."""

from __future__ import annotations

import numpy as np
import torch
from attrs import define

from asyncinfer.kvcache.pool import PageAllocator
from asyncinfer.kvcache.radix import RadixCache
from asyncinfer.scheduler.request import Req


@define
class PrefixCacheStats:
    """Prefix-cache lookups since the start, for metrics: one per admitted request (a
    recompute after a preemption is not a new request), with the prompt tokens queried and
    those found cached. A hit is a lookup that found at least one token."""

    queries: int = 0
    hits: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        """Count one lookup."""
        self.queries += 1
        self.hits += int(hit_tokens > 0)
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens


class CacheManager:
    """Hands out pages, writes them into the page table, and gives them back at the end.

    With ``cache_type="radix"`` a finished request's full pages stay in a prefix tree that
    later requests match against; unreferenced ones are evicted, least recently used first,
    when the free list runs short. With ``"naive"`` every page returns to the free list.
    """

    def __init__(self, num_pages: int, page_size: int, page_table: torch.Tensor,
                 cache_type: str) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.page_table = page_table
        self.allocator = PageAllocator(num_pages)
        self.radix = RadixCache(page_size) if cache_type == "radix" else None
        self.stats = PrefixCacheStats()

    @property
    def available_pages(self) -> int:
        """Pages that can be had now: free ones and evictable cached ones."""
        evictable = self.radix.evictable_pages if self.radix is not None else 0
        return self.allocator.num_free + evictable

    @property
    def cached_pages(self) -> int:
        """Pages owned by the prefix cache."""
        return self.radix.cached_pages if self.radix is not None else 0

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)

    def pages_to_finish(self, req: Req) -> int:
        """Pages ``req`` must still allocate to reach its longest possible length."""
        return self.pages_for(req.max_len) - len(req.pages)

    def match(self, req: Req) -> None:
        """Attach the longest cached prefix of the sequence to prefill (the prompt, and the
        outputs of a preempted request) to ``req`` and pin it."""
        if self.radix is None:
            return
        found = self.radix.match_prefix(req.token_ids())
        self.radix.lock(found.node)
        req.prefix_node = found.node
        req.pages = list(found.pages)
        req.shared_pages = len(found.pages)
        req.cached_len = found.num_tokens

    def unmatch(self, req: Req) -> None:
        """Undo ``match`` for a request that was not admitted after all."""
        if self.radix is not None and req.prefix_node is not None:
            self.radix.unlock(req.prefix_node)
        req.prefix_node, req.pages, req.shared_pages = None, [], 0
        req.cached_len = 0

    def admit(self, req: Req) -> None:
        """Write the shared prefix pages of a newly admitted request into its table row.

        A request's first admission also fixes its ``prefix_len`` and counts as one lookup in
        ``stats``; a recompute after a preemption changes neither.
        """
        if req.shared_pages:
            self._write(req.row, 0, req.pages[: req.shared_pages])
        if req.preemptions == 0:
            req.prefix_len = req.cached_len
            if self.radix is not None:
                self.stats.record(req.prompt_len, req.cached_len)

    def allocate(self, req: Req, end: int) -> None:
        """Give ``req`` pages for positions up to ``end``, evicting cached pages if needed."""
        need = self.pages_for(end) - len(req.pages)
        if need <= 0:
            return
        short = need - self.allocator.num_free
        if short > 0:
            assert self.radix is not None, "allocation beyond the free list without a cache"
            self.allocator.free(self.radix.evict(short))
        new = self.allocator.allocate(need)
        self._write(req.row, len(req.pages), new)
        req.pages.extend(new)

    def release(self, req: Req, keep: bool) -> None:
        """Return the pages of a finished or aborted request.

        With ``keep`` (a normal finish) its full pages of computed KV go to the prefix cache.
        """
        own = req.pages[req.shared_pages :]
        if self.radix is None:
            self.allocator.free(own)
        else:
            if keep:
                computed = req.token_ids()[: req.cached_len]
                self.allocator.free(self.radix.insert(computed, req.pages))
            else:
                self.allocator.free(own)
            if req.prefix_node is not None:
                self.radix.unlock(req.prefix_node)
        req.pages, req.shared_pages, req.prefix_node = [], 0, None

    def _write(self, row: int, first_page: int, pages: list[int]) -> None:
        size = self.page_size
        slots = (np.asarray(pages, np.int64)[:, None] * size + np.arange(size)).ravel()
        start = first_page * size
        if self.page_table.device.type == "cpu":
            self.page_table.numpy()[row, start : start + slots.size] = slots
        else:
            self.page_table[row, start : start + slots.size] = torch.from_numpy(slots).to(
                self.page_table.device)
