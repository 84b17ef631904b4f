"""A model-free engine: "KV" slots hold the token written there, and the next token is a
fixed function of the whole sequence read back through the page table.

If the scheduler maps a position to the wrong slot (a bad prefix match, a page freed while
in use), the sequence read back differs and so does the token: the outputs expose it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncinfer.core import Batch, ForwardOutput

EOS = 0


def next_token(sequence: Sequence[int], vocab: int, eos_every: int = 0) -> int:
    """The fake model: a rolling hash of the sequence; EOS when the hash says so."""
    h = 0
    for t in sequence:
        h = (h * 31 + t + 7) % 1_000_003
    if eos_every and h % eos_every == 0:
        return EOS
    return 1 + h % (vocab - 1)


class FakeEngine:
    """Implements the scheduler's BatchRunner protocol in microseconds per batch."""

    def __init__(self, num_pages: int = 64, page_size: int = 4, max_rows: int = 8,
                 context_len: int = 256, vocab: int = 50, eos_every: int = 0) -> None:
        self.num_pages, self.page_size, self.max_rows = num_pages, page_size, max_rows
        self.context_len, self.vocab, self.eos_every = context_len, vocab, eos_every
        width = -(-context_len // page_size) * page_size + 1
        self.page_table = torch.full((max_rows, width), -1, dtype=torch.int64)
        self.token_pool = torch.zeros((max_rows, width), dtype=torch.int64)
        self.kv: dict[int, int] = {}
        self.batches: list[Batch] = []

    def write_prompt(self, row: int, token_ids: Sequence[int]) -> None:
        self.token_pool[row, : len(token_ids)] = torch.tensor(list(token_ids))

    def forward(self, batch: Batch) -> ForwardOutput:
        self.batches.append(batch)
        table, pool = self.page_table.tolist(), self.token_pool.tolist()
        tokens = []
        for row, start, end, sample in zip(batch.rows, batch.starts, batch.ends, batch.sample):
            slots = table[row][:end]
            assert min(slots) >= 0, "a computed or attended position has no KV slot"
            for pos in range(start, end):
                self.kv[slots[pos]] = pool[row][pos]
            seq = [self.kv[s] for s in slots]
            token = next_token(seq, self.vocab, self.eos_every)
            tokens.append(token)
            if sample:
                self.token_pool[row, end] = token
        out = torch.tensor(tokens, dtype=torch.int64)
        return ForwardOutput(out, torch.zeros(len(tokens), 1))


def reference_output(prompt: Sequence[int], max_tokens: int, vocab: int, eos_every: int = 0,
                     ignore_eos: bool = False) -> list[int]:
    """What the fake model generates for one request run alone."""
    seq, out = list(prompt), []
    while len(out) < max_tokens:
        token = next_token(seq, vocab, eos_every)
        out.append(token)
        seq.append(token)
        if token == EOS and not ignore_eos:
            break
    return out
