"""The request table's free rows: which are free, which goes out next."""

from __future__ import annotations

from bisect import bisect_left


class RowTable:
    """Rows of the request table (the engine's token pool and page table), one per admitted
    request.

    The lowest free row goes out first: every tensor-parallel rank must form identical
    batches, so which row a request gets may depend only on the calls made, never on the
    order of a hash or a set. A request's own standing (no row, claimed, holding one) is its
    ``RowState``; this keeps the rows nobody holds.
    """

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._free = list(range(num_rows))     # ascending

    @property
    def num_free(self) -> int:
        """Rows nobody holds."""
        return len(self._free)

    @property
    def free_rows(self) -> list[int]:
        """The free rows, lowest first (a copy)."""
        return list(self._free)

    def allocate(self) -> int:
        """Take the lowest free row; the caller checked that one is free."""
        assert self._free, "no free row"
        return self._free.pop(0)

    def release(self, row: int) -> None:
        """Give ``row`` back."""
        at = bisect_left(self._free, row)
        assert 0 <= row < self.num_rows, f"row {row} is not in the table"
        assert at == len(self._free) or self._free[at] != row, f"row {row} released twice"
        self._free.insert(at, row)
