"""What the scheduler needs of an engine: the two tables it fills and a forward."""

from __future__ import annotations

from typing import Protocol

import torch

from asyncinfer.engine.batch import Batch
from asyncinfer.engine.runner import ForwardOutput


class Engine(Protocol):
    """A model runner as seen by the scheduler; tests drive the scheduler with a fake one."""

    page_table: torch.Tensor   # [rows, width]: KV slot of each position
    token_pool: torch.Tensor   # [rows, width]: token id of each position
    num_pages: int
    page_size: int
    max_rows: int
    context_len: int

    def forward(self, batch: Batch) -> ForwardOutput:
        """Run one batch; sampled tokens are written back to the token pool."""
        ...
