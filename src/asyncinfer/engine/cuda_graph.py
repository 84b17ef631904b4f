"""Decode forwards captured as CUDA graphs at a ladder of batch sizes, replayed with padding.

A decode batch of ``n`` requests replays the graph of the smallest captured size ``bs >= n``;
rows ``n .. bs`` are padding: they read token 0 of the scratch token-pool row, attend one
token of the scratch page and write their K, V there. Batches past the largest size run
eagerly. Graph inputs (token indices, positions, KV slots, flashinfer's page layout) live in
fixed device buffers that each replay refills, in stream order, before it runs.

Off CUDA nothing is captured and ``run`` calls the same forward directly on the same padded
buffers, so the padding logic is testable on a CPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from asyncinfer.attention.base import AttentionContext
from asyncinfer.attention.flashinfer_backend import (
    FlashInferBackend,
    FlashInferMetadata,
    PagedLayout,
)

logger = logging.getLogger(__name__)


def batch_size_ladder(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including ``max_bs``."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs]
    sizes += list(range(16, max_bs, 16))
    return [*sizes, max_bs]


class DecodeGraphs:
    """Captured decode forwards (model and attention; sampling stays outside)."""

    def __init__(self, backend: FlashInferBackend, forward: Callable[..., torch.Tensor],
                 token_pool: torch.Tensor, max_bs: int, max_pages: int,
                 device: torch.device) -> None:
        self.backend, self.forward, self.token_pool = backend, forward, token_pool
        self.device = device
        self.sizes = batch_size_ladder(max_bs)
        # inputs[0] token-pool index, inputs[1] position, inputs[2] KV slot, of each row
        self.inputs = torch.zeros(3, max_bs, dtype=torch.int64, device=device)
        self.indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.indices = torch.zeros(max_pages, dtype=torch.int32, device=device)
        self.last_page_len = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.wrappers = {bs: backend.graph_decode_wrapper(bs, self.indptr, self.indices,
                                                          self.last_page_len)
                         for bs in self.sizes}
        self.graphs: dict[int, Any] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def pick(self, n: int) -> int | None:
        """The graph size a batch of ``n`` replays, or None (run it eagerly)."""
        return next((bs for bs in self.sizes if bs >= n), None)

    def _run_forward(self, bs: int) -> torch.Tensor:
        index, positions, out_loc = self.inputs[0, :bs], self.inputs[1, :bs], self.inputs[2, :bs]
        input_ids = self.token_pool.view(-1)[index]
        attn = AttentionContext(self.backend, FlashInferMetadata(self.wrappers[bs], out_loc))
        return self.forward(input_ids, positions, attn)

    @torch.inference_mode()
    def capture(self, dummy_layout: Callable[[int], PagedLayout]) -> None:
        """Capture every size, largest first, into one memory pool (CUDA only)."""
        if self.device.type != "cuda":
            return
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for bs in reversed(self.sizes):
            with torch.cuda.stream(stream):
                self.backend.plan_decode(self.wrappers[bs], dummy_layout(bs))
                for _ in range(2):  # warm up outside the graph (allocator, lazy init)
                    self._run_forward(bs)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.logits[bs] = self._run_forward(bs)
            self.graphs[bs] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        logger.info("captured decode CUDA graphs for batch sizes %s in %.1f s", self.sizes,
                    time.perf_counter() - start)

    def run(self, bs: int, inputs: torch.Tensor, layout: PagedLayout) -> torch.Tensor:
        """Refill the buffers of size ``bs`` from host ``inputs`` [3, bs] and ``layout``
        (both already padded to ``bs``), replay, and return the logits [bs, vocab]."""
        self.inputs[:, :bs].copy_(inputs, non_blocking=True)
        self.backend.plan_decode(self.wrappers[bs], layout)
        graph = self.graphs.get(bs)
        if graph is None:  # not captured (CPU): the same forward, eagerly
            return self._run_forward(bs)
        graph.replay()
        return self.logits[bs]
