"""A discarded forward at start-up on a CPU, as many tokens as a round may hold, through the
model's first layer, so that the first requests do not pay for the memory a large forward
touches first (docs/architecture.md, "Warming up")."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from asyncinfer.core import Batch
from asyncinfer.params import SamplingParams

logger = logging.getLogger(__name__)


ROWS = 16
"""Rows the warm-up's tokens are spread over: a burst of prompts, not one long one (whose
attention alone would take seconds)."""


def warm_up_plan(tokens: int, rows: int, context: int, pages: int, page: int
                 ) -> tuple[int, int]:
    """``(rows, tokens per row)`` of the warm-up forward: ``tokens`` prompt tokens over
    ROWS rows (at most ``rows``), each row's tokens within the ``context`` and, with the
    one it samples, on whole pages of its own among the pool's ``pages``; fewer tokens
    where those run out, (0, 0) where not one fits."""
    count = max(0, min(rows, ROWS, tokens, pages))
    if count == 0:
        return 0, 0
    per = min(-(-tokens // count), context - 1, pages // count * page - 1)
    return (count, per) if per > 0 else (0, 0)


def warm_up(runner: Any, tokens: int) -> None:
    """One forward of up to ``tokens`` prompt tokens through the first layer, on a
    ModelRunner's first rows and pages (``Any``: the runner imports this module), its
    output dropped and its rows cleared. Its activations leave the C heap grown to a
    round's size (kept: "The C heap"; every layer's are alike); the pool's pages those
    rows hold are written in every layer, which commits the pages the allocator hands out
    first."""
    page = runner.page_size
    rows, per = warm_up_plan(tokens, runner.max_rows, runner.context_len, runner.num_pages,
                             page)
    if rows == 0:
        return
    start = time.perf_counter()
    span = -(-(per + 1) // page) * page
    for row in range(rows):
        runner.page_table[row, :span] = torch.arange(row * span, (row + 1) * span)
    runner.token_pool[:rows, :per].random_(0, runner.model_config.vocab_size,
                                           generator=torch.Generator().manual_seed(0))
    try:
        with runner.model.first_layers(1):
            runner.forward(Batch(rows=list(range(rows)), starts=[0] * rows,
                                 ends=[per] * rows,
                                 params=[SamplingParams(temperature=0.0)] * rows,
                                 steps=[0] * rows))
    finally:
        runner.page_table[:rows].zero_()
        runner.token_pool[:rows].zero_()
    runner.pool.k[:, :rows * span].zero_()
    runner.pool.v[:, :rows * span].zero_()
    logger.info("warmed up with a forward of %d prompt tokens through one layer in %.1f s",
                rows * per, time.perf_counter() - start)
