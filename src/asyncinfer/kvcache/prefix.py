"""Prefix caches: what the KV manager needs of one, and the one that shares nothing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from attrs import frozen

H = TypeVar("H")


@frozen
class PrefixMatch(Generic[H]):
    """The longest cached prefix: tokens, pages in order, and the handle that pins it."""

    num_tokens: int
    pages: list[int]
    handle: H


class PrefixCache(Protocol[H]):
    """Finished sequences' pages, adopted on ``insert``, never freed by the cache itself.
    Invariants: a locked prefix is never evicted; every choice follows from the calls alone."""

    shares: ClassVar[bool]
    """Whether a match can ever find anything (only then are lookups counted)."""

    @property
    def cached_pages(self) -> int:
        ...

    @property
    def evictable_pages(self) -> int:
        """Owned pages that :meth:`evict` can hand back now: those in no locked prefix."""
        ...

    @property
    def version(self) -> int:
        """A counter that changes whenever what a match can find changes."""
        ...

    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch[H]:
        """Longest cached whole-page prefix of ``tokens``, leaving at least the last token out
        (its logits are needed); ``tokens`` is never kept or changed."""
        ...

    def match_length(self, tokens: Sequence[int]) -> int:
        """``match_prefix``'s token count, changing nothing (no pin, no recency, no split)."""
        ...

    def lock(self, handle: H) -> None:
        """Keep the matched prefix of ``handle`` from being evicted until :meth:`unlock`."""
        ...

    def unlock(self, handle: H) -> None:
        ...

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Offer the full pages of a finished sequence's ``tokens``; return those not kept."""
        ...

    def adopt(self, tokens: Sequence[int], pages: Sequence[int]) -> H | None:
        """Take the full pages of a running sequence's computed ``tokens`` now, before it
        finishes; the handle to lock for its owner, or None where nothing was adopted."""
        ...

    def evict(self, num_pages: int, cleared: bool = False) -> list[int]:
        """Give back at least ``num_pages`` unlocked pages (fewer if fewer are evictable);
        ``cleared``: all of them, which empties the cache."""
        ...

    def take_events(self) -> list[Any]:
        """What was stored and evicted since the last call (KV-cache events, where they
        are published)."""
        ...


class NaiveCache:
    """The prefix cache that shares nothing: every page goes back to the free list."""

    shares: ClassVar[bool] = False
    cached_pages: ClassVar[int] = 0
    evictable_pages: ClassVar[int] = 0
    version: ClassVar[int] = 0

    def __init__(self, page_size: int) -> None:
        assert page_size > 0, f"page_size must be positive, got {page_size}"
        self.page_size = page_size

    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch[None]:
        return _NO_MATCH

    def match_length(self, tokens: Sequence[int]) -> int:
        return 0

    def lock(self, handle: None) -> None:
        pass

    def unlock(self, handle: None) -> None:
        pass

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        return list(pages)

    def adopt(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        return None

    def evict(self, num_pages: int, cleared: bool = False) -> list[int]:
        return []

    def take_events(self) -> list[Any]:
        return []


_NO_MATCH: PrefixMatch[None] = PrefixMatch(0, [], None)
