"""A request as the scheduler tracks it (what a round reports for it is ``core.Event``)."""

from __future__ import annotations

from enum import Enum
from typing import Any

from attrs import define, field

from asyncinfer.params import SamplingParams


class RowState(Enum):
    """Where a request stands with the request table (its row holds the request's tokens
    and page-table entries; see ``scheduler.table.RowTable``)."""

    NONE = "none"         # holds no row: not admitted yet, sent back to the queue, or done
    CLAIMED = "claimed"   # admitted into the prefill batch being formed; gets its row when
                          # the batch is built, so rows go out in batch order
    HELD = "held"         # holds the row ``Req.row``


@define(eq=False)
class Req:
    """One request: its tokens, where its KV lives, and how far it has got.

    Positions ``[0, cached_len)`` have KV computed or computing in a launched batch;
    ``device_len`` tokens are in its token pool row, counting a sampled token not yet seen
    by the host. ``output_ids`` are the tokens the host has received. ``pages`` covers the
    positions in order; the first ``shared_pages`` belong to the prefix cache, and
    ``prefix_handle`` is the lock it holds on them there (None while it shares none; see
    ``kvcache.prefix``).

    ``row`` is its table row while ``row_state`` is HELD, and None otherwise: a result of a
    batch that ran it in another row (or before it was sent back to the queue) is told apart
    by the row alone. Only the methods below move it between row states.

    A waiting request's prefill computes its whole sequence, ``seq_len`` tokens: the prompt,
    and for a request sent back to the queue (``preemptions > 0``) the outputs it had
    produced, so that it continues where it stopped. A ``suspect`` was in a batch that
    failed: it runs alone until a batch of its own samples a token.
    """

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

    @property
    def prompt_len(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        """Tokens so far: prompt and output."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_len(self) -> int:
        """The longest this request's sequence can get."""
        return self.prompt_len + self.max_tokens

    @property
    def admitted(self) -> bool:
        """Holds a table row (and so pages): its row state is HELD."""
        # Read for every waiting request every round: the row alone says it, and cheaper.
        return self.row is not None

    @property
    def remaining_tokens(self) -> int:
        """Output tokens it may still produce."""
        return self.max_tokens - len(self.output_ids)

    def token_ids(self) -> list[int]:
        """Prompt followed by output."""
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
        """Stop holding its row (HELD -> NONE) and return it, for the caller to free or to
        leave with a copy that frees it later."""
        row = self.row
        assert row is not None and self.row_state is RowState.HELD, (
            f"request {self.uid} holds no row")
        self.row, self.row_state = None, RowState.NONE
        return row
