"""Prefix caches: what the KV manager needs of one, and the one that shares nothing.

A prefix cache owns the KV pages of finished sequences so that later requests starting with
the same tokens reuse them instead of computing them again. The KV manager drives it
through :class:`PrefixCache` alone; the page allocator stays with the manager, so a cache
adopts pages on ``insert`` and hands pages back from ``insert`` and ``evict``, never freeing
any itself. Implementations: :class:`NaiveCache` here, ``radix.RadixCache`` (a prefix tree).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Generic, Protocol, TypeVar

from attrs import frozen

H = TypeVar("H")


@frozen
class PrefixMatch(Generic[H]):
    """The longest cached prefix: its length in tokens, its pages in order, and the handle
    that :meth:`PrefixCache.lock` and :meth:`PrefixCache.unlock` take to pin it."""

    num_tokens: int
    pages: list[int]
    handle: H


class PrefixCache(Protocol[H]):
    """A store of finished sequences' KV pages that later requests match their tokens against.

    A request matches its sequence, locks the match's handle while it uses those pages (a
    locked prefix is never evicted), and unlocks it exactly once when it is done; a match
    of no pages pins nothing, and its caller need not lock it. Every choice (what matches,
    what is evicted first) must follow from the calls made alone, so every tensor-parallel
    rank makes the same ones.
    """

    shares: ClassVar[bool]
    """Whether a match can ever find anything. Only a cache that shares counts its lookups
    (``scheduler.kv_manager.PrefixCacheStats``): without one the counts stay 0."""

    @property
    def cached_pages(self) -> int:
        """Pages the cache owns."""
        ...

    @property
    def evictable_pages(self) -> int:
        """Owned pages that :meth:`evict` can hand back now: those in no locked prefix."""
        ...

    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch[H]:
        """Longest cached whole-page prefix of ``tokens``, leaving at least the last token out
        (the caller computes at least one token, for the logits of the next one). ``tokens``
        is read during the call, never kept or changed."""
        ...

    def lock(self, handle: H) -> None:
        """Keep the matched prefix of ``handle`` from being evicted until :meth:`unlock`."""
        ...

    def unlock(self, handle: H) -> None:
        """Drop one lock taken by :meth:`lock`."""
        ...

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Offer the full pages of a finished sequence's computed ``tokens`` (``pages[i]``
        holds positions ``[i * page_size, (i + 1) * page_size)``); return the pages the
        cache does not keep, for the caller to free."""
        ...

    def evict(self, num_pages: int) -> list[int]:
        """Give back at least ``num_pages`` unlocked pages (fewer if fewer are evictable),
        for the caller to free."""
        ...


class NaiveCache:
    """The prefix cache that shares nothing: no match finds a token, nothing is kept, and
    every page of a finished sequence goes back to the free list."""

    shares: ClassVar[bool] = False
    cached_pages: ClassVar[int] = 0
    evictable_pages: ClassVar[int] = 0

    def __init__(self, page_size: int) -> None:
        assert page_size > 0, f"page_size must be positive, got {page_size}"
        self.page_size = page_size

    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch[None]:
        """Nothing: the empty prefix (one shared instance; its ``pages`` are never changed)."""
        return _NO_MATCH

    def lock(self, handle: None) -> None:
        """Nothing to pin."""

    def unlock(self, handle: None) -> None:
        """Nothing to unpin."""

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Keep nothing: every page goes back."""
        return list(pages)

    def evict(self, num_pages: int) -> list[int]:
        """Nothing is cached, so nothing can be evicted."""
        return []


_NO_MATCH: PrefixMatch[None] = PrefixMatch(0, [], None)
