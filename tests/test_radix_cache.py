"""The radix cache maps each cached whole-page prefix to the pages first stored for it,
conserves pages with the allocator, never evicts a locked path, and decides the same way
every time. The naive cache shares nothing and keeps nothing; both are the prefix caches the
KV manager picks by name."""

from __future__ import annotations

from typing import get_args

import pytest
from attrs import define
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from asyncinfer.config import CacheType
from asyncinfer.kvcache.pool import PageAllocator
from asyncinfer.kvcache.prefix import NaiveCache, PrefixCache, PrefixMatch
from asyncinfer.kvcache.radix import Chunk, Node, RadixCache
from asyncinfer.scheduler.kv_manager import PREFIX_CACHES


def cached_prefixes(cache: RadixCache) -> dict[tuple[Chunk, ...], int]:
    """Every whole-page prefix in the tree, mapped to the page of its last chunk."""
    found: dict[tuple[Chunk, ...], int] = {}
    stack: list[tuple[tuple[Chunk, ...], Node]] = [((), cache.root)]
    while stack:
        prefix, node = stack.pop()
        for chunk, page in zip(node.chunks, node.pages):
            prefix = (*prefix, chunk)
            found[prefix] = page
        stack.extend((prefix, child) for child in node.children.values())
    return found


def test_match_on_empty_tree_returns_root() -> None:
    cache = RadixCache(page_size=2)
    match = cache.match_prefix([1, 2, 3, 4, 5])
    assert (match.num_tokens, match.pages, match.handle) == (0, [], cache.root)


def test_match_returns_page_aligned_prefix_of_longer_sequence() -> None:
    cache = RadixCache(page_size=2)
    assert cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12]) == []
    match = cache.match_prefix([1, 2, 3, 4, 9, 9, 9])
    assert (match.num_tokens, match.pages) == (4, [10, 11])


def test_fully_cached_prompt_matches_one_page_less() -> None:
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4], [10, 11])
    assert cache.match_prefix([1, 2, 3, 4]).pages == [10]
    assert cache.match_prefix([1, 2, 3, 4, 5]).pages == [10, 11]
    assert cache.match_prefix([1]).num_tokens == 0


def test_insert_splits_an_edge_where_sequences_diverge() -> None:
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    cache.insert([1, 2, 7, 8], [20, 21])
    assert cache.cached_pages == 4
    assert [child.pages for child in cache.root.children.values()] == [[10]]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 0]).pages == [10, 11, 12]
    assert cache.match_prefix([1, 2, 7, 8, 0]).pages == [10, 21]


def test_match_ending_inside_an_edge_splits_it_so_the_lock_covers_only_the_match() -> None:
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    match = cache.match_prefix([1, 2, 3, 4, 0])
    assert match.handle.pages == [10, 11]
    cache.lock(match.handle)
    assert cache.evictable_pages == 1
    assert cache.evict(3) == [12]


def test_insert_returns_duplicate_chunks_and_tail_pages() -> None:
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4], [10, 11])
    # Page 10 is the tree's own (the caller matched it); 31 copies chunk [3, 4]; 33 is a tail.
    assert cache.insert([1, 2, 3, 4, 5, 6, 7], [10, 31, 32, 33]) == [31, 33]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7]).pages == [10, 11, 32]
    assert cache.cached_pages == 3


def test_evict_takes_least_recently_used_leaf_first() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2], [10, 11])
    cache.insert([5, 6], [20, 21])
    cache.match_prefix([1, 2, 0])
    assert cache.evict(1) == [20, 21]


def test_parent_becomes_evictable_once_its_children_are_gone() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2], [10, 11])
    cache.insert([1, 3], [10, 21])
    assert cache.evict(3) == [11, 21, 10]
    assert cache.cached_pages == cache.evictable_pages == 0


def test_locked_path_is_never_evicted() -> None:
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], [10, 11, 12])
    cache.insert([1, 4], [10, 21])
    match = cache.match_prefix([1, 2, 3, 0])
    cache.lock(match.handle)
    assert cache.evict(10) == [21]
    assert cache.cached_pages == 3
    cache.unlock(match.handle)
    assert sorted(cache.evict(10)) == [10, 11, 12]


@define
class Request:
    tokens: list[int]
    match: PrefixMatch[Node]
    fresh: list[int]


TOTAL_PAGES = 24


class RadixCacheMachine(RuleBasedStateMachine):
    """Requests share an allocator through the tree; a dict of prefix -> page is the model."""

    @initialize(page_size=st.sampled_from([1, 2, 3]))
    def start(self, page_size: int) -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(TOTAL_PAGES)
        self.cache = RadixCache(page_size)
        self.model: dict[tuple[Chunk, ...], int] = {}
        self.in_flight: list[Request] = []
        self.seen = (self.cache.version, dict(self.model))

    def chunks(self, tokens: list[int]) -> list[Chunk]:
        size = self.page_size
        return [tuple(tokens[i : i + size]) for i in range(0, len(tokens) // size * size, size)]

    def locked_prefixes(self) -> set[tuple[Chunk, ...]]:
        locked: set[tuple[Chunk, ...]] = set()
        for request in self.in_flight:
            chunks = self.chunks(request.tokens)[: len(request.match.pages)]
            locked.update(tuple(chunks[: i + 1]) for i in range(len(chunks)))
        return locked

    def evict(self, num_pages: int) -> list[int]:
        evictable, locked = self.cache.evictable_pages, self.locked_prefixes()
        freed = self.cache.evict(num_pages)
        assert len(freed) >= min(num_pages, evictable)
        assert self.cache.evictable_pages == evictable - len(freed)
        freed_set = set(freed)
        gone = {prefix for prefix, page in self.model.items() if page in freed_set}
        assert len(gone) == len(freed) and not gone & locked
        for prefix in gone:
            del self.model[prefix]
        self.allocator.free(freed)
        return freed

    @rule(tokens=st.lists(st.integers(0, 1), max_size=12))
    def admit(self, tokens: list[int]) -> None:
        length = self.cache.match_length(tokens)  # read only: no split, no recency
        match = self.cache.match_prefix(tokens)
        assert length == match.num_tokens
        chunks = self.chunks(tokens)
        limit = max(0, (len(tokens) - 1) // self.page_size)
        expected: list[int] = []
        while len(expected) < limit and tuple(chunks[: len(expected) + 1]) in self.model:
            expected.append(self.model[tuple(chunks[: len(expected) + 1])])
        assert match.pages == expected
        assert match.num_tokens == len(expected) * self.page_size
        self.cache.lock(match.handle)
        need = -(-len(tokens) // self.page_size) - len(match.pages)
        if need > self.allocator.num_free:
            self.evict(need - self.allocator.num_free)
        if need > self.allocator.num_free:
            self.cache.unlock(match.handle)
            return
        self.in_flight.append(Request(tokens, match, self.allocator.allocate(need)))

    @precondition(lambda self: self.in_flight)
    @rule(index=st.integers(0, 100), abort=st.booleans())
    def finish(self, index: int, abort: bool) -> None:
        request = self.in_flight.pop(index % len(self.in_flight))
        if abort:
            self.allocator.free(request.fresh)
        else:
            pages = request.match.pages + request.fresh
            chunks = self.chunks(request.tokens)
            expected: list[int] = []
            for i, page in enumerate(pages[: len(chunks)]):
                kept = self.model.setdefault(tuple(chunks[: i + 1]), page)
                if kept != page:
                    expected.append(page)
            returned = self.cache.insert(request.tokens, pages)
            assert returned == expected + pages[len(chunks) :]
            self.allocator.free(returned)
        self.cache.unlock(request.match.handle)

    @rule(num_pages=st.integers(0, TOTAL_PAGES))
    def evict_some(self, num_pages: int) -> None:
        self.evict(num_pages)

    @invariant()
    def tree_holds_exactly_the_model(self) -> None:
        assert cached_prefixes(self.cache) == self.model
        assert self.cache.cached_pages == len(self.model)

    @invariant()
    def the_version_changes_exactly_when_what_matches_does(self) -> None:
        version, model = self.seen
        assert (self.cache.version != version) == (self.model != model)
        self.seen = (self.cache.version, dict(self.model))

    @invariant()
    def pages_are_conserved_and_owned_once(self) -> None:
        fresh = [page for request in self.in_flight for page in request.fresh]
        # Taking every free page and giving it back shows the free list without reaching in.
        free = self.allocator.allocate(self.allocator.num_free)
        self.allocator.free(free)
        owned = free + list(self.model.values()) + fresh
        assert len(owned) == TOTAL_PAGES
        assert sorted(owned) == list(range(TOTAL_PAGES))

    @invariant()
    def evictable_pages_are_those_off_locked_paths(self) -> None:
        locked = self.locked_prefixes()
        assert self.cache.evictable_pages == len(self.model.keys() - locked)
        assert self.cache.evictable_pages <= self.cache.cached_pages


RadixCacheMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None
)
TestRadixCacheMachine = RadixCacheMachine.TestCase


def scripted_evictions(look: bool = False) -> list[list[int]]:
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4, 5, 6], [0, 1, 2])
    cache.insert([1, 2, 3, 4, 7, 8], [0, 1, 3])
    cache.insert([9, 9, 1, 2], [4, 5])
    cache.insert([1, 2, 8, 8, 8], [0, 6, 7])
    held = cache.match_prefix([9, 9, 1, 2, 0]).handle
    cache.lock(held)
    if look:  # read-only lookups of everything, in the other order: nothing changes
        for tokens in ([1, 2, 3, 4, 7, 8, 0], [1, 2, 8, 8, 8], [1, 2, 3, 4, 5, 6, 0]):
            cache.match_length(tokens)
    cache.match_prefix([1, 2, 3, 4, 7, 8, 0])
    evictions = [cache.evict(1) for _ in range(4)]
    cache.unlock(held)
    evictions += [cache.evict(1) for _ in range(3)]
    return evictions


def test_same_calls_give_same_eviction_order() -> None:
    first = scripted_evictions()
    assert first == scripted_evictions() == scripted_evictions(look=True)
    assert sorted(page for pages in first for page in pages) == [0, 1, 2, 3, 4, 5, 6]


def test_naive_cache_matches_nothing_and_returns_every_page() -> None:
    cache = NaiveCache(page_size=2)
    match = cache.match_prefix([1, 2, 3, 4, 5])
    assert (match.num_tokens, match.pages) == (0, [])
    cache.lock(match.handle)
    assert cache.evict(4) == []
    cache.unlock(match.handle)
    assert cache.insert([1, 2, 3, 4, 5], [10, 11, 12]) == [10, 11, 12]
    assert cache.match_prefix([1, 2, 3, 4, 5]).pages == []
    assert cache.match_length([1, 2, 3, 4, 5]) == cache.version == 0
    assert cache.cached_pages == cache.evictable_pages == 0


@pytest.mark.parametrize("name", get_args(CacheType))
def test_each_cache_type_shares_a_finished_prefix_exactly_when_it_says_so(name: str) -> None:
    """Every ``cache_type`` the config offers names a cache; one that ``shares`` hands a
    later request the pages of a finished one's prefix, and one that does not keeps none."""
    cache: PrefixCache[object] = PREFIX_CACHES[name](2)
    returned = cache.insert([1, 2, 3, 4, 5], [10, 11, 12])
    found = cache.match_prefix([1, 2, 3, 4, 9]).pages
    if cache.shares:
        assert (found, returned, cache.cached_pages) == ([10, 11], [12], 2)
    else:
        assert (found, sorted(returned), cache.cached_pages) == ([], [10, 11, 12], 0)
