"""Forwards captured as CUDA graphs and replayed with padding: decode batches at a ladder of
batch sizes, prefill batches at a ladder of token counts.

A forward launched from Python pays the host's launch of every kernel of every layer; a
replay is one launch, so the host's share of a round no longer grows with the layer count.
Sampling stays outside the graphs: each returns logits, which the sampler reads as it reads
an eager forward's.

Decode. A decode batch of ``n`` requests replays the graph of the smallest captured size
``bs >= n``; rows ``n .. bs`` are padding: they read the token at ``pad_index`` of the token
pool (its scratch row), attend one token of the backend's pad page and write their K, V at
``pad_slot`` there. The graph returns the logits of every row.

Prefill. Any other batch (prompts, chunks of prompts, and decoding requests mixed with
those) of ``t`` tokens and ``n`` requests replays the graph of the smallest captured token
count ``T >= t`` that has more than ``n`` rows: ``min(PREFILL_MAX_REQUESTS, T - 1) + 1`` of
them (a batch of at most ``T`` tokens where one request computes two or more holds at most
``T - 1`` requests; one row is kept for padding). Tokens ``t .. T`` are padding (token
``pad_index``, position 0, KV slot ``pad_slot``), owned by the graph's last row, a padding
request that attends them on the pad page; its other unused rows are padding requests with no
token (``attention.base.GraphShape``). The graph gathers each row's last token (like the
eager forward's ``last_index``) and returns the logits of those.

Batches past the largest sizes run eagerly: there the kernels' work dwarfs their launch.

Graph inputs (token indices, positions, KV slots, each request's last token) live in one
device buffer that each replay refills, in stream order, before it runs; the attention
backend keeps its own static metadata per graph and refills it
(``AttentionBackend.prepare_replay``). Only the backend protocol is used here, so any backend
that is ``capturable`` can be replayed.

All graphs are captured into one memory pool, largest first (the prefill graphs, then the
decode ones): graphs replay one at a time, so each reuses what the larger ones needed for
their intermediates. The prefill graphs copy their logits into one buffer they share, so that
no output of theirs stays held in the pool.

Off CUDA nothing is captured and ``run`` calls the same forward directly on the same padded
buffers, so the padding logic is testable on a CPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from attrs import define

from asyncinfer.attention.base import AttentionBackend, AttentionContext, GraphShape, Phase
from asyncinfer.attention.transfer import pin
from asyncinfer.core import Batch
from asyncinfer.errors import ConfigError

logger = logging.getLogger(__name__)

GraphForward = Callable[[torch.Tensor, torch.Tensor, AttentionContext, torch.Tensor | None],
                        torch.Tensor]
"""``forward(input_ids, positions, attn, last)``: the model's logits of the tokens at the
indices ``last`` (of every token when None)."""

PREFILL_MAX_REQUESTS = 64
"""The most requests a prefill graph takes. A prefill round admits the few requests that
arrived since the last one; each row a graph has costs it a row of logits and, in the
attention kernel's schedule, a work tile (and workspace) whether a request fills it or not."""


def batch_size_ladder(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including ``max_bs``."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_bs]
    sizes += list(range(16, max_bs, 16))
    return [*sizes, max_bs]


def token_count_ladder(max_tokens: int) -> list[int]:
    """64, 128, 192, 256, 384, 512, 768, ... (powers of two and 1.5 times them) up to and
    including ``max_tokens``: past 64 tokens a batch is padded to at most 1.5 times its own
    (below 64 a forward's time hardly depends on its token count)."""
    sizes, size = [64], 128
    while size < max_tokens:
        sizes += [size, size * 3 // 2]
        size *= 2
    return [*(s for s in sizes if s < max_tokens), max_tokens]


@define
class Graph:
    """One forward of a fixed shape: its attention context and, once captured, its CUDA
    graph and output (``logits`` [shape.rows, vocab], rewritten by every replay)."""

    shape: GraphShape
    context: AttentionContext
    cuda_graph: Any = None        # torch.cuda.CUDAGraph
    logits: torch.Tensor | None = None
    replays: int = 0


class CudaGraphs:
    """Captured decode and prefill forwards (model and attention; sampling stays outside).

    ``forward`` computes the logits (``GraphForward``). ``max_prefill_tokens`` below 2 (no
    prefill has fewer) captures no prefill graph. A backend that cannot be captured is
    refused with a ConfigError.
    """

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
        # inputs[0] token-pool index, [1] position, [2] KV slot of each token; [3] the index
        # of each request row's last token (prefill; a request row never outnumbers tokens)
        self.inputs = torch.zeros(4, width, dtype=torch.int64, device=device)
        # What padding puts there (host), a column per token or row.
        self.padding = torch.tensor([[pad_index], [0], [pad_slot], [0]]).expand(4, width)
        backend.init_graph_state(shapes)
        graphs = [Graph(shape, AttentionContext(backend, backend.graph_metadata(
            shape, self.inputs[2, : shape.tokens]))) for shape in shapes]
        self.prefill = [g for g in graphs if g.shape.phase == "prefill"]   # smallest first
        self.decode = [g for g in graphs if g.shape.phase == "decode"]
        self._prefill_logits: torch.Tensor | None = None

    def pick(self, phase: Phase, requests: int, tokens: int) -> Graph | None:
        """The graph a batch of ``requests`` computing ``tokens`` replays, or None (run it
        eagerly)."""
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
            # A request of one token on table row 0; the rest is padding.
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
        """Free every captured graph now, whoever still holds this object or its graphs
        (their replay counts stay readable): a graph keeps what it captured, a tensor-
        parallel group's collectives included, and that group cannot be torn down while a
        graph holds them. A released graph replays as the eager forward would run."""
        for graph in [*self.prefill, *self.decode]:
            if graph.cuda_graph is not None:
                graph.cuda_graph.reset()
            graph.cuda_graph, graph.logits = None, None
        self._prefill_logits = None

    def run(self, graph: Graph, batch: Batch, inputs: torch.Tensor, last: torch.Tensor,
            computing: Callable[[], None] | None = None) -> torch.Tensor:
        """Replay ``graph`` for ``batch`` (which fits it: ``pick``). ``inputs`` [3, t] (host)
        are the token-pool index, position and KV slot of each of its tokens, ``last`` [n]
        (host) the index of each request's last token among them. Returns the logits
        [n, vocab] of those last tokens. ``computing`` is called once the inputs are
        staged, just before the replay."""
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
