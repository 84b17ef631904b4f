"""Admission control for one prefill round: token budget, free rows, KV reservations."""

from __future__ import annotations

from attrs import define, field

from asyncinfer.scheduler.kv_manager import KVManager
from asyncinfer.scheduler.request import Req


@define
class PrefillAdder:
    """Admits requests into a prefill batch while a row, the token budget and the pages
    they may ever need (after ``reserved_pages``) allow: running requests never run dry."""

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
        # A recompute after a preemption is chunked even with chunked prefill off.
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
