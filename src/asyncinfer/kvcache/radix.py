"""The radix cache: a prefix tree over whole pages of tokens, so requests share common KV."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import ClassVar

from attrs import define, field

from asyncinfer.kvcache import events as kv_events
from asyncinfer.kvcache.prefix import PrefixMatch

Chunk = tuple[int, ...]


@define(eq=False)
class Node:
    """An edge of page-sized token chunks below ``parent``, with the page holding each chunk."""

    chunks: list[Chunk]
    pages: list[int]
    parent: Node | None
    creation_id: int
    last_access: int
    ref_count: int = 0
    children: dict[Chunk, Node] = field(factory=dict)
    hashes: list[bytes] = field(factory=list)   # each page's, where events are published


class RadixCache:
    """A ``PrefixCache`` over a tree whose nodes own pages; a handle is the deepest matched
    node and locks its path. Every order comes from counters, the same on every rank."""

    shares: ClassVar[bool] = True

    def __init__(self, page_size: int) -> None:
        assert page_size > 0, f"page_size must be positive, got {page_size}"
        self.page_size = page_size
        self._clock = 0
        self._next_id = 0
        self._cached = 0
        self._evictable = 0
        self._version = 0
        self.root = self._new_node([], [], None)
        # What was stored and evicted since the last take_events (None: nobody asked).
        self.events: list[kv_events.KVEvent] | None = None
        self.medium = kv_events.MEDIUM

    def publish_events(self, medium: str) -> None:
        """From now on record what is stored and evicted (``take_events``), in vLLM's
        schema, the pages on ``medium``; starts with AllBlocksCleared (the cache is empty)."""
        assert not self._cached, "events start with an empty cache"
        self.events, self.medium = [kv_events.AllBlocksCleared()], medium

    def take_events(self) -> list[kv_events.KVEvent]:
        """The events since the last call (none where nobody asked for them)."""
        if not self.events:
            return []
        taken, self.events = self.events, []
        return taken
    @property
    def cached_pages(self) -> int:
        return self._cached

    @property
    def evictable_pages(self) -> int:
        """Pages in unreferenced nodes, which evicting leaves over and over would free."""
        return self._evictable

    @property
    def version(self) -> int:
        """Bumped by every insert that adds pages and every eviction."""
        return self._version

    def match_length(self, tokens: Sequence[int]) -> int:
        """Tokens ``match_prefix`` would find, read only: O(pages matched), no chunk list."""
        size, limit = self.page_size, max(0, (len(tokens) - 1) // self.page_size)
        node, i = self.root, 0
        while i < limit:
            child = node.children.get(tuple(tokens[i * size : (i + 1) * size]))
            if child is None:
                break
            for j, chunk in enumerate(child.chunks):  # chunk 0 is the key just matched
                if j and (i >= limit or chunk != tuple(tokens[i * size : (i + 1) * size])):
                    return i * size
                i += 1
            node = child
        return min(i, limit) * size

    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch[Node]:
        """Longest cached whole-page prefix, the last token left out; handle: its last node."""
        num_chunks = max(0, (len(tokens) - 1) // self.page_size)
        node, pages = self._walk(self._chunks(tokens, num_chunks))
        return PrefixMatch(len(pages) * self.page_size, pages, node)

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Cache the full pages of ``tokens``; return the pages to free (copies, the tail)."""
        num_chunks = len(tokens) // self.page_size
        assert len(pages) >= num_chunks, f"{len(tokens)} tokens need {num_chunks} pages"
        chunks = self._chunks(tokens, num_chunks)
        node, cached = self._walk(chunks)
        # The caller passes back the pages it matched; only a second copy of a chunk is freed.
        to_free = [mine for mine, kept in zip(pages, cached) if mine != kept]
        have = len(cached)
        if have < num_chunks:
            self._add_leaf(node, chunks[have:], list(pages[have:num_chunks]))
        return to_free + list(pages[num_chunks:])

    def adopt(self, tokens: Sequence[int], pages: Sequence[int]) -> Node | None:
        """Cache the full pages of a running sequence's ``tokens`` (computed KV) and return
        the node to lock for it; None, adopting nothing, where the cache holds another copy
        of a chunk past the ones ``pages`` shares with it (the owner keeps its pages)."""
        num_chunks = len(tokens) // self.page_size
        assert len(pages) >= num_chunks, f"{len(tokens)} tokens need {num_chunks} pages"
        chunks = self._chunks(tokens, num_chunks)
        node, cached = self._walk(chunks)
        if any(mine != kept for mine, kept in zip(pages, cached)):
            return None
        have = len(cached)
        if have == num_chunks:
            return node
        return self._add_leaf(node, chunks[have:], list(pages[have:num_chunks]))

    def _add_leaf(self, parent: Node, chunks: list[Chunk], pages: list[int]) -> Node:
        leaf = self._new_node(chunks, pages, parent)
        parent.children[leaf.chunks[0]] = leaf
        self._cached += len(leaf.pages)
        self._evictable += len(leaf.pages)
        self._version += 1
        if self.events is not None:
            before = parent.hashes[-1] if parent.hashes else None
            digest = before
            for chunk in chunks:
                digest = kv_events.page_hash(digest, chunk)
                leaf.hashes.append(digest)
            self.events.append(kv_events.BlockStored(
                [kv_events.external(h) for h in leaf.hashes],
                None if before is None else kv_events.external(before),
                [t for chunk in chunks for t in chunk], self.page_size, None, self.medium,
                None))
        return leaf

    def lock(self, node: Node) -> None:
        """Keep ``node`` and its ancestors from being evicted until :meth:`unlock`."""
        walker: Node | None = node
        while walker is not None:
            if walker.ref_count == 0:
                self._evictable -= len(walker.pages)
            walker.ref_count += 1
            walker = walker.parent

    def unlock(self, node: Node) -> None:
        """Drop one reference taken by :meth:`lock` on ``node`` and its ancestors."""
        walker: Node | None = node
        while walker is not None:
            assert walker.ref_count > 0, "unlock without a matching lock"
            walker.ref_count -= 1
            if walker.ref_count == 0:
                self._evictable += len(walker.pages)
            walker = walker.parent

    def evict(self, num_pages: int, cleared: bool = False) -> list[int]:
        """Free at least ``num_pages`` pages (fewer if fewer are evictable), LRU leaves first;
        ``cleared``: the caller frees everything, told as AllBlocksCleared, not leaf by leaf."""
        heap = [(n.last_access, n.creation_id, n) for n in self._leaves() if n.ref_count == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.chunks[0]]
            freed.extend(leaf.pages)
            if self.events is not None and not cleared:
                self.events.append(kv_events.BlockRemoved(
                    [kv_events.external(h) for h in leaf.hashes], self.medium))
            self._cached -= len(leaf.pages)
            self._evictable -= len(leaf.pages)
            if parent is not self.root and not parent.children and parent.ref_count == 0:
                heapq.heappush(heap, (parent.last_access, parent.creation_id, parent))
        if freed:
            self._version += 1
        if cleared and self.events is not None:
            assert not self._cached, "cleared, yet pages are still cached"
            self.events.append(kv_events.AllBlocksCleared())
        return freed

    def _new_node(self, chunks: list[Chunk], pages: list[int], parent: Node | None) -> Node:
        node = Node(chunks, pages, parent, self._next_id, self._clock)
        self._next_id += 1
        return node

    def _chunks(self, tokens: Sequence[int], num_chunks: int) -> list[Chunk]:
        size = self.page_size
        return [tuple(tokens[i * size : (i + 1) * size]) for i in range(num_chunks)]

    def _walk(self, chunks: list[Chunk]) -> tuple[Node, list[int]]:
        """Follow and touch ``chunks`` as far as cached, splitting the edge where they stop."""
        self._clock += 1
        node, pages, i = self.root, [], 0
        node.last_access = self._clock
        while i < len(chunks) and (child := node.children.get(chunks[i])) is not None:
            same = _common_length(child.chunks, chunks[i:])
            if same < len(child.chunks):
                child = self._split(child, same)
            child.last_access = self._clock
            pages.extend(child.pages)
            node, i = child, i + same
        return node, pages

    def _split(self, node: Node, at: int) -> Node:
        """Cut ``node``'s edge after ``at`` chunks into a new parent that inherits its
        references; ``node`` stays the handle of its lock holders."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.chunks)
        upper = self._new_node(node.chunks[:at], node.pages[:at], parent)
        upper.hashes, node.hashes = node.hashes[:at], node.hashes[at:]
        upper.ref_count = node.ref_count
        upper.last_access = node.last_access
        # Reassigning an existing key keeps its place in the dict, so child order is unchanged.
        parent.children[node.chunks[0]] = upper
        node.chunks, node.pages, node.parent = node.chunks[at:], node.pages[at:], upper
        upper.children[node.chunks[0]] = node
        return upper

    def _leaves(self) -> list[Node]:
        leaves, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        return leaves


def _common_length(a: Sequence[Chunk], b: Sequence[Chunk]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n
