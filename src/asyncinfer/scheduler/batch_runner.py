"""What the scheduler needs of a model runner: the two tables it fills and a forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from asyncinfer.core import Batch, ForwardOutput


class BatchRunner(Protocol):
    """A model runner as the scheduler sees it (``tests/fake_engine.py`` is a fake one)."""

    page_table: torch.Tensor   # [rows, width]: KV slot of each position, on the host
    token_pool: torch.Tensor   # [rows, width]: token id of each position
    num_pages: int
    page_size: int
    max_rows: int
    context_len: int

    def write_prompt(self, row: int, token_ids: Sequence[int]) -> None:
        """Put a newly admitted request's prompt into its token-pool row."""
        ...

    def forward(self, batch: Batch) -> ForwardOutput:
        """Run one batch; sampled tokens are written back to the token pool."""
        ...
