"""The waiting queue and the running set as a policy reads them: lazy sequences whose cost
is what a policy looks at, not their length. See docs/architecture.md, 'Scheduler view cost'.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from itertools import islice
from typing import Any, Literal, overload

from asyncinfer.policies.records import RunningRequest, WaitingRequest

Key = Callable[[WaitingRequest], Any]


class WaitingView(Sequence[WaitingRequest]):
    """Waiting requests in queue order (arrival order, preempted ones in front).

    ``len`` is O(1); iterating, ``window(k)`` and ``[:k]`` build the first k records only.
    Subclasses that index incrementally override ``ordered`` and ``waited_at_least``."""

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[WaitingRequest]:
        raise NotImplementedError

    @overload
    def __getitem__(self, index: int) -> WaitingRequest: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[WaitingRequest, ...]: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.start, index.stop, index.step
            if all(i is None or i >= 0 for i in (start, stop)) and (step or 1) > 0:
                return tuple(islice(self, start, stop, step))
            return tuple(self)[index]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("waiting index out of range")
        return next(islice(self, index, None))

    def __reversed__(self) -> Iterator[WaitingRequest]:
        return reversed(tuple(self))

    def index(self, value: Any, start: int = 0, stop: int | None = None) -> int:
        return tuple(self).index(value, start, len(self) if stop is None else stop)

    def window(self, k: int) -> tuple[WaitingRequest, ...]:
        """The first ``k`` requests in queue order: O(k)."""
        return tuple(islice(self, max(0, k)))

    def place(self, uid: int) -> int:
        """A number that orders requests as the queue does (for tie-breaks)."""
        for i, req in enumerate(self):
            if req.uid == uid:
                return i
        raise KeyError(uid)

    def ordered(self, name: Hashable, key: Key) -> Iterator[WaitingRequest]:
        """The queue by ``key`` (lowest first), ties in queue order. ``key`` may read only
        what stays fixed while a request waits (not ``waited_rounds``: use arrival_round);
        ``name`` identifies the key, so an index kept under it is reused across rounds."""
        return (req for _, req in sorted(enumerate(self), key=lambda item: (key(item[1]),
                                                                            item[0])))

    def longest_match_first(self) -> Iterator[WaitingRequest]:
        """The queue by ``prefix_match``, longest first, ties in queue order."""
        return self.ordered("prefix_match", lambda req: -req.prefix_match)

    def waited_at_least(self, rounds: int) -> Iterator[WaitingRequest]:
        """Those that waited ``rounds`` or more, in queue order."""
        return (req for req in self if req.waited_rounds >= rounds)

    def tenants(self) -> frozenset[str]:
        """The tenants with a request waiting."""
        return frozenset(req.tenant for req in self)

    def of_tenant(self, tenant: str) -> Iterator[WaitingRequest]:
        """One tenant's requests, in queue order."""
        return (req for req in self if req.tenant == tenant)


class TupleWaiting(WaitingView):
    """A WaitingView over a tuple of records (hand-built views); everything scans."""

    def __init__(self, records: Iterable[WaitingRequest]) -> None:
        self._records = tuple(records)
        self._places: dict[int, int] | None = None

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[WaitingRequest]:
        return iter(self._records)

    def __getitem__(self, index: Any) -> Any:
        return self._records[index]

    def place(self, uid: int) -> int:
        if self._places is None:
            self._places = {r.uid: i for i, r in enumerate(self._records)}
        return self._places[uid]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TupleWaiting):
            return self._records == other._records
        return isinstance(other, tuple) and self._records == other

    def __hash__(self) -> int:
        return hash(self._records)

    def __repr__(self) -> str:
        return f"TupleWaiting({self._records!r})"


class RunningView(Sequence[RunningRequest]):
    """Running requests in uid order: ``len`` O(1), records built as iterated."""

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[RunningRequest]:
        raise NotImplementedError

    def __getitem__(self, index: Any) -> Any:
        return tuple(self)[index]

    def __reversed__(self) -> Iterator[RunningRequest]:
        return reversed(tuple(self))

    def worst_priority(self) -> int | None:
        """The highest (worst) priority running, None if nothing runs."""
        return max((r.priority for r in self), default=None)


class TupleRunning(RunningView):
    """A RunningView over a tuple of records."""

    def __init__(self, records: Iterable[RunningRequest]) -> None:
        self._records = tuple(records)

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[RunningRequest]:
        return iter(self._records)

    def __getitem__(self, index: Any) -> Any:
        return self._records[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TupleRunning):
            return self._records == other._records
        return isinstance(other, tuple) and self._records == other

    def __hash__(self) -> int:
        return hash(self._records)

    def __repr__(self) -> str:
        return f"TupleRunning({self._records!r})"


def as_waiting(value: Any) -> WaitingView:
    return value if isinstance(value, WaitingView) else TupleWaiting(value)


def as_running(value: Any) -> RunningView:
    return value if isinstance(value, RunningView) else TupleRunning(value)


SKIP_WINDOW = 64
"""Candidates a skipping policy offers beyond the free slots (each misfit costs a lookup)."""


def fresh(requests: Iterable[WaitingRequest], count: int) -> list[WaitingRequest]:
    """The first ``count`` requests not yet started (chunked ones resume anyway)."""
    return list(islice((r for r in requests if not r.chunked), max(0, count)))


def candidates(waiting: WaitingView, free_slots: int, order: Iterable[WaitingRequest],
               old_after: int | None, on_young: Literal["stop", "skip"], extra_slots: int = 0
               ) -> tuple[list[int], Literal["stop", "skip"]]:
    """Uids to offer and the misfit rule: requests waited ``old_after`` rounds first in queue
    order and stopping, then ``order``; ``order`` alone with ``on_young`` if none is old.

    Stopping, no more than the rows can take are offered (``free_slots + extra_slots + 1``,
    the same batch as offering all); skipping, ``SKIP_WINDOW`` beyond the free rows."""
    stop_count = free_slots + extra_slots + 1
    old = fresh(waiting.waited_at_least(old_after), stop_count) if old_after is not None else []
    if not old:
        if on_young == "stop":
            return [r.uid for r in fresh(order, stop_count)], "stop"
        count = free_slots + extra_slots + SKIP_WINDOW if free_slots + extra_slots > 0 else 0
        return [r.uid for r in fresh(order, count)], "skip"
    assert old_after is not None
    young = fresh((r for r in order if r.waited_rounds < old_after), stop_count - len(old))
    return [r.uid for r in old + young], "stop"
