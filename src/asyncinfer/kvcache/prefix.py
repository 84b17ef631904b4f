"""Prefix caches: what the KV manager needs of one, and the one that shares nothing.

A cache adopts pages on ``insert`` and hands pages back from ``insert`` and ``evict``; it
never frees any itself (the allocator stays with the KV manager).
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
    """Finished sequences' KV pages that later requests match their tokens against.

    Invariants: a locked prefix is never evicted; each lock is unlocked once; every choice
    follows from the calls made alone, so every rank makes the same ones."""

    shares: ClassVar[bool]
    """Whether a match can ever find anything (only then are lookups counted)."""

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
        (its logits are needed); ``tokens`` is never kept or changed."""
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
    """The prefix cache that shares nothing: every page goes back to the free list."""

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
