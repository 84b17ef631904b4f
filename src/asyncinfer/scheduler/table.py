"""The request table's free rows."""

from __future__ import annotations

from bisect import bisect_left


class RowTable:
    """Rows of the token pool and page table; the lowest free goes out first, so every
    rank hands out the same rows."""

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._free = list(range(num_rows))     # ascending

    @property
    def num_free(self) -> int:
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
        at = bisect_left(self._free, row)
        assert 0 <= row < self.num_rows, f"row {row} is not in the table"
        assert at == len(self._free) or self._free[at] != row, f"row {row} released twice"
        self._free.insert(at, row)
