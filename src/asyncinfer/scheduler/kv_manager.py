"""The KV manager: pages for requests, shared through a prefix cache (or not)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from attrs import define

from asyncinfer.kvcache.pool import PageAllocator
from asyncinfer.kvcache.prefix import NaiveCache, PrefixCache
from asyncinfer.kvcache.radix import RadixCache
from asyncinfer.scheduler.request import Req

PREFIX_CACHES: dict[str, Callable[[int], PrefixCache[Any]]] = {
    "naive": NaiveCache,    # no sharing: every page returns to the free list
    "radix": RadixCache,    # a prefix tree of finished sequences' full pages
}
"""``EngineConfig.cache_type`` -> the prefix cache it names, built from the page size."""


@define
class PrefixCacheStats:
    """Prefix-cache lookups, one per first admission, counted only by a cache that shares."""

    queries: int = 0
    hits: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        self.queries += 1
        self.hits += int(hit_tokens > 0)
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens


class KVManager:
    """Hands out pages, writes them into the page table and takes them back, sharing them
    through the prefix cache ``cache_type`` names (pinned while matched, evicted when short)."""

    def __init__(self, num_pages: int, page_size: int, page_table: torch.Tensor,
                 cache_type: str) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.page_table = page_table
        self.allocator = PageAllocator(num_pages)
        self.prefix: PrefixCache[Any] = PREFIX_CACHES[cache_type](page_size)
        self.stats = PrefixCacheStats()
        self.epoch = 0    # bumped whenever a request's pages change
        self.on_admit: Callable[[Req], None] = lambda req: None  # told of each admission

    @property
    def available_pages(self) -> int:
        """Pages that can be had now: free ones and evictable cached ones."""
        return self.allocator.num_free + self.prefix.evictable_pages

    @property
    def cached_pages(self) -> int:
        return self.prefix.cached_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages_to_finish(self, req: Req) -> int:
        """Pages ``req`` must still allocate to reach its longest possible length."""
        return self.pages_for(req.max_len) - len(req.pages)

    @property
    def cache_version(self) -> int:
        """Changes whenever what a lookup can find changes."""
        return self.prefix.version

    def match_length(self, req: Req) -> int:
        """Tokens of ``req``'s sequence the prefix cache holds now; pins and touches nothing."""
        if req.params.prompt_logprobs is not None:
            return 0
        return self.prefix.match_length(req.token_ids() if req.output_ids else req.prompt_ids)

    def match(self, req: Req) -> None:
        """Attach the longest cached prefix of ``req``'s sequence to it and pin it. A
        request asking for prompt logprobs matches nothing: a cached prefix has no logits,
        so its prompt is computed whole (see docs/architecture.md, "Logprobs")."""
        if req.params.prompt_logprobs is not None:
            self.epoch += 1
            req.pages, req.shared_pages, req.cached_len = [], 0, 0
            return
        found = self.prefix.match_prefix(req.token_ids() if req.output_ids else req.prompt_ids)
        self.epoch += 1
        if found.pages:  # an empty prefix has no pages to pin
            self.prefix.lock(found.handle)
            req.prefix_handle = found.handle
        req.pages = list(found.pages)
        req.shared_pages = len(found.pages)
        req.cached_len = found.num_tokens

    def unmatch(self, req: Req) -> None:
        """Undo ``match`` for a request that was not admitted after all."""
        if req.prefix_handle is not None:
            self.prefix.unlock(req.prefix_handle)
        req.prefix_handle, req.pages, req.shared_pages = None, [], 0
        req.cached_len = 0
        self.epoch += 1

    def admit(self, req: Req) -> None:
        """Write a newly admitted request's shared pages into its row; a first admission
        also fixes ``prefix_len`` and counts one lookup."""
        self.on_admit(req)
        if req.shared_pages:
            self._write(req, 0, req.pages[: req.shared_pages])
        if req.preemptions == 0:
            req.prefix_len = req.cached_len
            if self.prefix.shares:
                self.stats.record(req.prompt_len, req.cached_len)

    def allocate(self, req: Req, end: int) -> None:
        """Give ``req`` pages for positions up to ``end``, evicting cached pages if needed."""
        need = self.pages_for(end) - len(req.pages)
        if need <= 0:
            return
        self.epoch += 1
        short = need - self.allocator.num_free
        if short > 0:  # admission counted these as evictable
            self.allocator.free(self.prefix.evict(short))
        new = self.allocator.allocate(need)
        self._write(req, len(req.pages), new)
        req.pages.extend(new)

    def share(self, req: Req) -> None:
        """Hand ``req``'s full prompt pages (their KV computed) to the prefix cache while it
        runs, pinned for it, so requests admitted from now on find them: the other choices
        of an ``n`` > 1 request prefill only the prompt's last, partial page. See
        docs/architecture.md, 'Choices sharing the prompt'."""
        full = req.prompt_len // self.page_size
        if full <= req.shared_pages or req.cached_len < full * self.page_size:
            return
        handle = self.prefix.adopt(req.prompt_ids[: full * self.page_size], req.pages[:full])
        if handle is None:
            return
        self.prefix.lock(handle)
        if req.prefix_handle is not None:
            self.prefix.unlock(req.prefix_handle)
        req.prefix_handle, req.shared_pages = handle, full
        self.epoch += 1

    def release(self, req: Req, keep: bool) -> None:
        """Return a request's pages and unpin its prefix; ``keep`` (a normal finish) offers
        its computed full pages to the prefix cache, else (KV maybe corrupt) they are freed."""
        self.epoch += 1
        if keep:
            computed = req.token_ids()[: req.cached_len]
            self.allocator.free(self.prefix.insert(computed, req.pages))
        else:
            self.allocator.free(req.pages[req.shared_pages :])
        if req.prefix_handle is not None:
            self.prefix.unlock(req.prefix_handle)
        req.pages, req.shared_pages, req.prefix_handle = [], 0, None

    def flush_cache(self) -> tuple[int, int]:
        """Empty the prefix cache of every page no request holds; (pages freed, cached
        pages left, which running requests hold)."""
        everything = self.prefix.evictable_pages == self.prefix.cached_pages
        freed = self.prefix.evict(self.prefix.evictable_pages, cleared=everything)
        self.allocator.free(freed)
        self.epoch += 1
        return len(freed), self.prefix.cached_pages

    def _write(self, req: Req, first_page: int, pages: list[int]) -> None:
        """Point positions from ``first_page`` on of ``req``'s row at ``pages``' slots."""
        row = req.row
        assert row is not None, f"request {req.uid} holds no row"
        size = self.page_size
        slots = (np.asarray(pages, np.int64)[:, None] * size + np.arange(size)).ravel()
        start = first_page * size
        self.page_table.numpy()[row, start : start + slots.size] = slots  # a host tensor
