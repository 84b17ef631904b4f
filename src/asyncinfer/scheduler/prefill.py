"""Admission control for one prefill round: token budget, free slots, and KV reservations."""

from __future__ import annotations

from attrs import define, field

from asyncinfer.scheduler.kv_manager import KVManager
from asyncinfer.scheduler.request import Req


@define
class PrefillAdder:
    """Admits requests one by one into a prefill batch while they fit.

    A request fits when a table row is free, the round's token budget has room for its
    sequence (its prompt, with its outputs after a preemption; or, with chunked prefill, for
    a first chunk of it), and the pages it may ever need fit in what is available after
    every admitted request's own future needs are reserved, so running requests never run
    out of KV. A newly admitted request claims a row (``free_slots`` counts the unclaimed
    ones); the scheduler hands out the rows themselves when it builds the batch.
    """

    kv: KVManager
    token_budget: int
    free_slots: int
    reserved_pages: int
    chunked_prefill: bool
    admitted: list[tuple[Req, int]] = field(factory=list)   # (request, end of this round)

    def try_add(self, req: Req) -> bool:
        """Admit ``req`` (or its next chunk) if it fits; False leaves it untouched."""
        if self.token_budget <= 0:
            return False
        if req.admitted:  # a chunked prefill resuming: its pages are reserved already
            return self._take_chunk(req)
        if self.free_slots <= 0:
            return False
        self.kv.match(req)
        need = self.kv.pages_to_finish(req)
        extend = req.seq_len - req.cached_len
        # A recompute (prompt and outputs, after a preemption) may exceed the budget its
        # prompt was checked against: it is chunked even with chunked prefill off.
        fits_budget = extend <= self.token_budget or self.chunked_prefill or req.preemptions > 0
        if not fits_budget or need > self.kv.available_pages - self.reserved_pages:
            self.kv.unmatch(req)
            return False
        self.free_slots -= 1
        self.reserved_pages += need
        req.claim_row()  # the scheduler gives it its row as it builds the batch
        return self._take_chunk(req)

    def _take_chunk(self, req: Req) -> bool:
        end = min(req.seq_len, req.cached_len + self.token_budget)
        self.token_budget -= end - req.cached_len
        self.admitted.append((req, end))
        return True
