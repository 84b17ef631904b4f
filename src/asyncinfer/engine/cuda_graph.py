"""Forwards captured as CUDA graphs and replayed with padding: decode batches at a ladder of
batch sizes, prefill and mixed batches at a ladder of token counts. See
docs/architecture.md, 'CUDA graphs'."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from attrs import define

from asyncinfer.attention.base import AttentionBackend, AttentionContext, GraphShape, Phase
from asyncinfer.attention.host_to_device import pin
from asyncinfer.core import Batch
from asyncinfer.errors import ConfigError

logger = logging.getLogger(__name__)

GraphForward = Callable[[torch.Tensor, torch.Tensor, AttentionContext, torch.Tensor | None],
                        torch.Tensor]
"""``forward(input_ids, positions, attn, last)``: the model's logits of the tokens at the
indices ``last`` (of every token when None)."""

PREFILL_MAX_REQUESTS = 64
"""The most requests a prefill graph takes (each row costs logits and a work tile)."""


def batch_size_ladder(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including ``max_bs``."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs]
    sizes += list(range(16, max_bs, 16))
    return [*sizes, max_bs]


def token_count_ladder(max_tokens: int) -> list[int]:
    """64, 128, 192, 256, 384, ... (powers of two and 1.5 times them) up to ``max_tokens``."""
    sizes, size = [64], 128
    while size < max_tokens:
        sizes += [size, size * 3 // 2]
        size *= 2
    return [*(s for s in sizes if s < max_tokens), max_tokens]


@define
class Graph:
    """One forward of a fixed shape: its attention context, CUDA graph and output logits."""

    shape: GraphShape
    context: AttentionContext
    cuda_graph: Any = None        # torch.cuda.CUDAGraph
    logits: torch.Tensor | None = None
    replays: int = 0


class CudaGraphs:
    """Captured decode and prefill forwards (sampling stays outside); ``max_prefill_tokens``
    below 2 captures no prefill graph. A backend that cannot be captured: ConfigError."""

    def __init__(self, backend: AttentionBackend, forward: GraphForward,
                 token_pool: torch.Tensor, max_bs: int, max_prefill_tokens: int,
                 pad_index: int, pad_slot: int, device: torch.device) -> None:
        if not backend.capturable:
            raise ConfigError(f"{type(backend).__name__} cannot be captured in CUDA graphs; "
                              "use cuda_graph=False with it")
        self.backend, self.forward, self.token_pool = backend, forward, token_pool
        self.device = device
        self.decode_sizes = batch_size_ladder(max_bs)
        self.prefill_sizes = (token_count_ladder(max_prefill_tokens)
                              if max_prefill_tokens > 1 else [])
        shapes = [*(GraphShape("prefill", min(PREFILL_MAX_REQUESTS, t - 1) + 1, t)
                    for t in self.prefill_sizes),
                  *(GraphShape("decode", bs, bs) for bs in self.decode_sizes)]
        width = max(shape.tokens for shape in shapes)
        # rows: token-pool index, position, KV slot of each token; each request's last token
        self.inputs = torch.zeros(4, width, dtype=torch.int64, device=device)
        self.padding = torch.tensor([[pad_index], [0], [pad_slot], [0]]).expand(4, width)
        backend.init_graph_state(shapes)
        graphs = [Graph(shape, AttentionContext(backend, backend.graph_metadata(
            shape, self.inputs[2, : shape.tokens]))) for shape in shapes]
        self.prefill = [g for g in graphs if g.shape.phase == "prefill"]   # smallest first
        self.decode = [g for g in graphs if g.shape.phase == "decode"]
        self._prefill_logits: torch.Tensor | None = None

    def pick(self, phase: Phase, requests: int, tokens: int) -> Graph | None:
        """The graph a batch of ``requests`` and ``tokens`` replays; None: run it eagerly."""
        if phase == "decode":
            return next((g for g in self.decode if g.shape.rows >= requests), None)
        return next((g for g in self.prefill
                     if g.shape.tokens >= tokens and g.shape.rows > requests), None)

    def _run_forward(self, graph: Graph) -> torch.Tensor:
        shape = graph.shape
        input_ids = self.token_pool.view(-1)[self.inputs[0, : shape.tokens]]
        last = None if shape.phase == "decode" else self.inputs[3, : shape.rows]
        return self.forward(input_ids, self.inputs[1, : shape.tokens], graph.context, last)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every graph, largest first, into one memory pool (CUDA only)."""
        if self.device.type != "cuda":
            return
        logger.info("capturing CUDA graphs: decode of %s requests, %s", self.decode_sizes,
                    f"prefill of {self.prefill_sizes} tokens" if self.prefill else "no prefill")
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # while capturing, every token is padding
            self.inputs.copy_(self.padding)
        for graph in [*reversed(self.prefill), *reversed(self.decode)]:
            self._capture(graph, pool, stream)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        prefill = (f"prefill of {self.prefill_sizes} tokens (up to {PREFILL_MAX_REQUESTS} "
                   "requests)" if self.prefill else "no prefill")
        logger.info("captured CUDA graphs in %.1f s: decode of %s requests, %s",
                    time.perf_counter() - start, self.decode_sizes, prefill)

    def _capture(self, graph: Graph, pool: Any, stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):
            self.backend.prepare_replay(graph.context.meta, [0], [0], [1])
            for _ in range(2):  # warm up outside the graph (allocator, lazy init)
                out = self._run_forward(graph)
        stream.synchronize()
        prefill = graph.shape.phase == "prefill"
        if prefill and self._prefill_logits is None:  # the largest prefill comes first
            self._prefill_logits = out.new_empty(graph.shape.rows, out.shape[1])
        del out
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph, pool=pool, stream=stream):
            logits = self._run_forward(graph)
            if prefill:  # into the shared buffer: the pool gets its own output back
                assert self._prefill_logits is not None
                graph.logits = self._prefill_logits[: graph.shape.rows]
                graph.logits.copy_(logits)
            else:
                graph.logits = logits
        graph.cuda_graph = cuda_graph

    def release(self) -> None:
        """Free every captured graph now; a released graph runs eagerly."""
        for graph in [*self.prefill, *self.decode]:
            if graph.cuda_graph is not None:
                graph.cuda_graph.reset()
            graph.cuda_graph, graph.logits = None, None
        self._prefill_logits = None

    def run(self, graph: Graph, batch: Batch, inputs: torch.Tensor, last: torch.Tensor,
            computing: Callable[[], None] | None = None) -> torch.Tensor:
        """Replay ``graph`` for ``batch`` (``inputs`` [3, t]: index, position, KV slot per
        token; ``last`` [n]); the logits [n, vocab] of each request's last token."""
        shape, n = graph.shape, batch.size
        padded = self.padding[:, : shape.tokens].clone()
        padded[:3, : inputs.shape[1]] = inputs
        padded[3, :n] = last
        self.inputs[:, : shape.tokens].copy_(pin(padded, self.device), non_blocking=True)
        self.backend.prepare_replay(graph.context.meta, batch.rows, batch.starts, batch.ends)
        graph.replays += 1
        if computing is not None:
            computing()
        if graph.cuda_graph is None:  # not captured (CPU): the same forward, eagerly
            return self._run_forward(graph)[:n]
        graph.cuda_graph.replay()
        assert graph.logits is not None
        return graph.logits[:n]
