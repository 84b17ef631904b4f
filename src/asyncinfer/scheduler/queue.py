"""The waiting queue and the running set, and the lazy views a policy reads them through:
no per-round operation walks the queue. See docs/architecture.md, 'Scheduler view cost'."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

from asyncinfer.policies.base import RunningRequest, WaitingRequest
from asyncinfer.policies.view import Key, RunningView, WaitingView
from asyncinfer.scheduler.request import Req

MAX_INDEXES = 8       # orders kept for policies (least recently used dropped)
MATCH_REFRESH = 16    # prefix-cache lookups a round spends refreshing stale matches


class _Index:
    """Waiting uids sorted by (key, place): the key taken when the request was queued."""

    def __init__(self, key: Key) -> None:
        self.key = key
        self.entries: list[tuple[Any, int, int]] = []
        self.entry_of: dict[int, tuple[Any, int, int]] = {}

    def add(self, record: WaitingRequest, place: int) -> None:
        entry = (self.key(record), place, record.uid)
        insort(self.entries, entry)
        self.entry_of[record.uid] = entry

    def remove(self, uid: int) -> None:
        entry = self.entry_of.pop(uid, None)
        if entry is not None:
            del self.entries[bisect_left(self.entries, entry)]


class WaitingQueue:
    """Requests waiting for (the rest of) their prefill, by uid, in queue order: arrival
    order, those sent back by a preemption in front. Every operation is O(1) or O(log n)
    but building an index. Invariants: ``_place`` increases along the queue; ``_admitted``
    is the set of those holding a row; every index and tenant list holds exactly the queue."""

    def __init__(self, record: Callable[[Req], WaitingRequest],
                 match: Callable[[Req], int], version: Callable[[], int]) -> None:
        self._record, self._match, self._version = record, match, version
        self._reqs: OrderedDict[int, Req] = OrderedDict()
        self._place: dict[int, int] = {}
        self._front = self._back = 0
        self._admitted: set[int] = set()
        self.epoch = 0                      # bumped whenever ``_admitted`` changes
        self._tenants: dict[str, OrderedDict[int, None]] = {}
        self._indexes: OrderedDict[Hashable, _Index] = OrderedDict()
        self._matching = False              # matches are kept (a policy orders by them)
        self._cycle: deque[int] = deque()   # refresh order of matches
        self._in_cycle: set[int] = set()
        self._fresh_seen, self._seen_version = 0, -1

    def __len__(self) -> int:
        return len(self._reqs)

    def __bool__(self) -> bool:
        return bool(self._reqs)

    def __iter__(self) -> Iterator[Req]:
        return iter(self._reqs.values())

    def __contains__(self, uid: object) -> bool:
        return uid in self._reqs

    def __getitem__(self, uid: int) -> Req:
        return self._reqs[uid]

    def get(self, uid: int) -> Req | None:
        return self._reqs.get(uid)

    def place(self, uid: int) -> int:
        return self._place[uid]

    def append(self, req: Req) -> None:
        """Queue a request at the back."""
        self._back += 1
        self._insert(req, self._back)
        self._tenants.setdefault(req.params.tenant, OrderedDict())[req.uid] = None

    def push_front(self, req: Req) -> None:
        """Queue a request in front of all others (a preempted one)."""
        self._front -= 1
        self._insert(req, self._front)
        self._reqs.move_to_end(req.uid, last=False)
        queue = self._tenants.setdefault(req.params.tenant, OrderedDict())
        queue[req.uid] = None
        queue.move_to_end(req.uid, last=False)

    def pop(self, uid: int) -> Req | None:
        """Take a request out of the queue; None if it is not there."""
        req = self._reqs.pop(uid, None)
        if req is None:
            return None
        del self._place[uid]
        if uid in self._admitted:
            self._admitted.remove(uid)
            self.epoch += 1
        queue = self._tenants[req.params.tenant]
        del queue[uid]
        if not queue:
            del self._tenants[req.params.tenant]
        for index in self._indexes.values():
            index.remove(uid)
        return req

    def remove(self, req: Req) -> None:
        assert self.pop(req.uid) is req, f"request {req.uid} is not waiting"

    def note_admitted(self, req: Req) -> None:
        """``req`` took its row while still waiting for part of its prefill."""
        if req.uid in self._reqs:
            self._admitted.add(req.uid)
            self.epoch += 1

    def admitted(self) -> list[Req]:
        """The requests holding a row (half-prefilled), in queue order: O(rows)."""
        return [self._reqs[u] for u in sorted(self._admitted, key=self._place.__getitem__)]

    def _insert(self, req: Req, place: int) -> None:
        assert req.uid not in self._reqs, f"request {req.uid} queued twice"
        self._reqs[req.uid] = req
        self._place[req.uid] = place
        if self._matching:
            self._refresh(req)
            if req.uid not in self._in_cycle:
                self._cycle.append(req.uid)
                self._in_cycle.add(req.uid)
        if self._indexes:
            record = self._record(req)
            for index in self._indexes.values():
                index.add(record, place)

    # ---- what the lazy view reads ------------------------------------------------------

    def index(self, name: Hashable, key: Key) -> _Index:
        """The queue's order by ``key``, kept under ``name``: built once (O(n log n)), then
        updated as requests come and go."""
        index = self._indexes.get(name)
        if index is None:
            index = _Index(key)
            for req in self._reqs.values():
                index.add(self._record(req), self._place[req.uid])
            self._indexes[name] = index
            while len(self._indexes) > MAX_INDEXES:
                self._indexes.popitem(last=False)
        self._indexes.move_to_end(name)
        return index

    def refresh_matches(self) -> None:
        """Keep prefix matches from now on; look up at most MATCH_REFRESH stale ones."""
        if not self._matching:
            self._matching = True
            for req in self._reqs.values():
                self._refresh(req)
                self._cycle.append(req.uid)
                self._in_cycle.add(req.uid)
            self._seen_version = self._version()
            return
        version = self._version()
        if version != self._seen_version:
            self._seen_version, self._fresh_seen = version, 0
        looked = popped = 0
        while (self._cycle and looked < MATCH_REFRESH and popped < 4 * MATCH_REFRESH
               and self._fresh_seen < len(self._reqs)):
            uid = self._cycle.popleft()
            popped += 1
            found = self._reqs.get(uid)
            if found is None:
                self._in_cycle.discard(uid)
                continue
            self._cycle.append(uid)
            self._fresh_seen += 1
            if found.match_version != version:
                looked += 1
                before = found.match_len
                self._refresh(found)
                if found.match_len != before:
                    self._rekey(found)

    def _refresh(self, req: Req) -> None:
        req.match_len, req.match_version = self._match(req), self._version()

    def _rekey(self, req: Req) -> None:
        if self._indexes:
            record, place = self._record(req), self._place[req.uid]
            for index in self._indexes.values():
                index.remove(req.uid)
                index.add(record, place)

    def tenant_uids(self, tenant: str) -> Iterator[int]:
        return iter(self._tenants.get(tenant, ()))

    def tenants(self) -> frozenset[str]:
        return frozenset(self._tenants)

    def check(self) -> None:
        """Assert the invariants (a test helper: O(n log n))."""
        places = [self._place[u] for u in self._reqs]
        assert places == sorted(places) and len(self._place) == len(self._reqs)
        assert self._admitted == {u for u, r in self._reqs.items() if r.admitted}, (
            self._admitted)
        for tenant, queue in self._tenants.items():
            assert list(queue) == [u for u, r in self._reqs.items()
                                   if r.params.tenant == tenant] != []
        assert sum(map(len, self._tenants.values())) == len(self._reqs)
        for index in self._indexes.values():
            assert sorted(index.entry_of) == sorted(self._reqs)
            assert index.entries == sorted(index.entry_of.values())


class LiveWaiting(WaitingView):
    """The policy's view of a WaitingQueue in one round: records built as read, once."""

    def __init__(self, queue: WaitingQueue, record: Callable[[Req], WaitingRequest],
                 round_: int) -> None:
        self._queue, self._make, self._round = queue, record, round_
        self._records: dict[int, WaitingRequest] = {}

    def _record(self, req: Req) -> WaitingRequest:
        record = self._records.get(req.uid)
        if record is None:
            record = self._records[req.uid] = self._make(req)
        return record

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[WaitingRequest]:
        return (self._record(req) for req in self._queue)

    def place(self, uid: int) -> int:
        return self._queue.place(uid)

    def ordered(self, name: Hashable, key: Key) -> Iterator[WaitingRequest]:
        index, queue = self._queue.index(name, key), self._queue
        return (self._record(queue[uid]) for _, _, uid in index.entries)

    def longest_match_first(self) -> Iterator[WaitingRequest]:
        self._queue.refresh_matches()
        for uid in list(self._records):  # records read before the refresh
            req = self._queue[uid]
            if self._records[uid].prefix_match != req.match_len:
                del self._records[uid]
        return super().longest_match_first()

    def waited_at_least(self, rounds: int) -> Iterator[WaitingRequest]:
        # Behind the preempted ones the queue is in arrival order: the first young request
        # never preempted has only younger ones behind it.
        for req in self._queue:
            if self._round - req.arrival_round >= rounds:
                yield self._record(req)
            elif req.preemptions == 0:
                return

    def tenants(self) -> frozenset[str]:
        return self._queue.tenants()

    def of_tenant(self, tenant: str) -> Iterator[WaitingRequest]:
        queue = self._queue
        return (self._record(queue[uid]) for uid in queue.tenant_uids(tenant))


class RunningSet(Mapping[int, Req]):
    """Decoding requests by uid, iterated in uid order (set order differs between ranks)
    without a sort per round; counts priorities for ``worst_priority``."""

    def __init__(self) -> None:
        self._reqs: dict[int, Req] = {}
        self._order: list[int] = []
        self._list: list[Req] | None = []
        self._priorities: Counter[int] = Counter()
        self.epoch = 0                      # bumped whenever a request comes or goes

    def __getitem__(self, uid: int) -> Req:
        return self._reqs[uid]

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, uid: object) -> bool:
        return uid in self._reqs

    def __setitem__(self, uid: int, req: Req) -> None:
        assert uid not in self._reqs, f"request {uid} runs twice"
        self._reqs[uid] = req
        insort(self._order, uid)
        self._priorities[req.params.priority] += 1
        self._list = None
        self.epoch += 1

    def __delitem__(self, uid: int) -> None:
        req = self._reqs.pop(uid)
        del self._order[bisect_left(self._order, uid)]
        self._priorities[req.params.priority] -= 1
        if not self._priorities[req.params.priority]:
            del self._priorities[req.params.priority]
        self._list = None
        self.epoch += 1

    def pop(self, uid: int, default: Req | None = None) -> Req | None:
        if uid not in self._reqs:
            return default
        req = self._reqs[uid]
        del self[uid]
        return req

    def in_uid_order(self) -> list[Req]:
        """The requests in uid order (a shared list: do not change it)."""
        if self._list is None:
            self._list = [self._reqs[u] for u in self._order]
        return self._list

    def worst_priority(self) -> int | None:
        return max(self._priorities, default=None)


class LiveRunning(RunningView):
    """The policy's view of the running set: records built as iterated."""

    def __init__(self, running: RunningSet, round_: int) -> None:
        self._running, self._round = running, round_

    def __len__(self) -> int:
        return len(self._running)

    def __iter__(self) -> Iterator[RunningRequest]:
        return (_running_record(r) for r in self._running.in_uid_order())

    def __getitem__(self, index: Any) -> Any:
        reqs = self._running.in_uid_order()
        if isinstance(index, slice):
            return tuple(_running_record(r) for r in reqs[index])
        return _running_record(reqs[index])

    def worst_priority(self) -> int | None:
        return self._running.worst_priority()


def _running_record(r: Req) -> RunningRequest:
    return RunningRequest(r.uid, r.seq_len, r.remaining_tokens, r.params.priority,
                          r.arrival_round, r.params.tenant)
