"""Decode forwards captured as CUDA graphs at a ladder of batch sizes, replayed with padding.

A decode batch of ``n`` requests replays the graph of the smallest captured size ``bs >= n``;
rows ``n .. bs`` are padding: they read the token at ``pad_index`` of the token pool (its
scratch row), attend one token of the backend's pad page and write their K, V at
``pad_slot`` there. Batches past the largest size run eagerly. Graph inputs (token indices,
positions, KV slots) live in fixed device buffers that each replay refills, in stream order,
before it runs; the attention backend keeps its own static metadata per size and refills it
(``AttentionBackend.prepare_replay``). Only the backend protocol is used here, so any backend
that is ``capturable`` can be replayed.

Off CUDA nothing is captured and ``run`` calls the same forward directly on the same padded
buffers, so the padding logic is testable on a CPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from asyncinfer.attention.base import AttentionBackend, AttentionContext
from asyncinfer.attention.transfer import pin
from asyncinfer.errors import ConfigError

logger = logging.getLogger(__name__)

GraphForward = Callable[[torch.Tensor, torch.Tensor, AttentionContext], torch.Tensor]


def batch_size_ladder(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including ``max_bs``."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs]
    sizes += list(range(16, max_bs, 16))
    return [*sizes, max_bs]


class DecodeGraphs:
    """Captured decode forwards (model and attention; sampling stays outside).

    ``forward(input_ids, positions, attn)`` returns the logits of each row. A backend that
    cannot be captured is refused with a ConfigError.
    """

    def __init__(self, backend: AttentionBackend, forward: GraphForward,
                 token_pool: torch.Tensor, max_bs: int, pad_index: int, pad_slot: int,
                 device: torch.device) -> None:
        if not backend.capturable:
            raise ConfigError(f"{type(backend).__name__} cannot be captured in CUDA graphs; "
                              "use cuda_graph=False with it")
        self.backend, self.forward, self.token_pool = backend, forward, token_pool
        self.device = device
        self.sizes = batch_size_ladder(max_bs)
        # inputs[0] token-pool index, inputs[1] position, inputs[2] KV slot, of each row
        self.inputs = torch.zeros(3, max_bs, dtype=torch.int64, device=device)
        # What padding rows put there (host), a column per row.
        self.padding = torch.tensor([[pad_index], [0], [pad_slot]]).expand(3, max_bs)
        backend.init_graph_state(max_bs)
        self.contexts = {bs: AttentionContext(backend,
                                              backend.graph_metadata(bs, self.inputs[2, :bs]))
                         for bs in self.sizes}
        self.graphs: dict[int, Any] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def pick(self, n: int) -> int | None:
        """The graph size a batch of ``n`` replays, or None (run it eagerly)."""
        return next((bs for bs in self.sizes if bs >= n), None)

    def _run_forward(self, bs: int) -> torch.Tensor:
        input_ids = self.token_pool.view(-1)[self.inputs[0, :bs]]
        return self.forward(input_ids, self.inputs[1, :bs], self.contexts[bs])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one memory pool (CUDA only)."""
        if self.device.type != "cuda":
            return
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for bs in reversed(self.sizes):
            with torch.cuda.stream(stream):
                # A batch of one token on row 0; the other rows are padding.
                self.backend.prepare_replay(self.contexts[bs].meta, [0], [1])
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

    def run(self, bs: int, inputs: torch.Tensor, rows: Sequence[int],
            ends: Sequence[int]) -> torch.Tensor:
        """Replay the graph of size ``bs`` for a decode batch of ``n = len(rows) <= bs``
        requests whose KV ends at ``ends``; ``inputs`` [3, n] (host) are the token-pool
        index, position and KV slot of each. Returns the logits [n, vocab]."""
        n = len(rows)
        padded = torch.cat([inputs, self.padding[:, : bs - n]], dim=1)
        self.inputs[:, :bs].copy_(pin(padded, self.device), non_blocking=True)
        self.backend.prepare_replay(self.contexts[bs].meta, rows, ends)
        graph = self.graphs.get(bs)
        if graph is None:  # not captured (CPU): the same forward, eagerly
            return self._run_forward(bs)[:n]
        graph.replay()
        return self.logits[bs][:n]
