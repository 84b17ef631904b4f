"""A request as the scheduler tracks it (what a round reports for it is ``core.Event``)."""

from __future__ import annotations

from enum import Enum
from typing import Any

from attrs import define, field

from asyncinfer.core import TokenLogprob
from asyncinfer.params import SamplingParams


class RowState(Enum):
    """Where a request stands with the request table (``scheduler.table.RowTable``)."""

    NONE = "none"         # holds no row: not admitted yet, sent back to the queue, or done
    CLAIMED = "claimed"   # admitted into the batch being formed; its row comes at build
    HELD = "held"         # holds the row ``Req.row``


@define(eq=False)
class Req:
    """One request: its tokens, where its KV lives, and how far it has got.

    Invariants: ``[0, cached_len)`` has KV computed or launched; the first ``shared_pages``
    are the prefix cache's, locked by ``prefix_handle``; ``row`` is set iff HELD."""

    uid: int
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int                     # clamped to what fits the context and the pool
    arrival_round: int
    row: int | None = None
    row_state: RowState = RowState.NONE
    cached_len: int = 0
    prefix_len: int = 0                 # tokens found in the prefix cache at first admission
    output_ids: list[int] = field(factory=list)
    pages: list[int] = field(factory=list)
    shared_pages: int = 0
    prefix_handle: Any = None
    device_len: int = 0
    finished: bool = False
    preemptions: int = 0                # times sent back to the waiting queue
    suspect: bool = False
    match_len: int = 0                  # prefix-cache match when last looked up (a hint)
    match_version: int = -1             # the prefix cache's version at that lookup
    # With prompt_logprobs: entry i is prompt token i + 1's, gathered chunk by chunk until
    # they go out with the first token (or the finish of a request that samples none).
    scored: list[TokenLogprob] = field(factory=list)
    scored_sent: bool = False

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_len(self) -> int:
        """The longest this request's sequence can get."""
        return self.prompt_len + self.max_tokens

    @property
    def scoring(self) -> bool:
        """Its prompt logprobs are still to be computed."""
        return self.params.prompt_logprobs is not None and not self.scored_sent

    @property
    def admitted(self) -> bool:
        """Holds a table row (and so pages): its row state is HELD."""
        return self.row is not None

    @property
    def remaining_tokens(self) -> int:
        """Output tokens it may still produce."""
        return self.max_tokens - len(self.output_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def claim_row(self) -> None:
        """Mark it admitted into the prefill batch being formed (NONE -> CLAIMED)."""
        assert self.row_state is RowState.NONE, f"request {self.uid} claims a second row"
        self.row_state = RowState.CLAIMED

    def take_row(self, row: int) -> None:
        """Give it ``row`` as its prefill batch is built (CLAIMED -> HELD)."""
        assert self.row_state is RowState.CLAIMED, f"request {self.uid} took an unclaimed row"
        self.row, self.row_state = row, RowState.HELD

    def drop_row(self) -> int:
        """Stop holding its row (HELD -> NONE) and return it."""
        row = self.row
        assert row is not None and self.row_state is RowState.HELD, (
            f"request {self.uid} holds no row")
        self.row, self.row_state = None, RowState.NONE
        return row
