"""The CUDA runner: flashinfer attention, decode CUDA graphs, and launch without blocking.

``launch(batch)`` runs on the coordinator's thread and only enqueues: it builds the batch's
indices on the host from the host page table, uploads them from pinned memory with
non-blocking copies, plans flashinfer, replays a graph (or runs eagerly), samples, writes the
sampled ids into the device token pool, starts a non-blocking copy of them into pinned host
memory and records an event. The returned ``wait`` blocks on that event, in the coordinator's
waiter thread: the copy of the sampled tokens is the one host synchronisation of a step.

All of it goes onto one engine stream, in launch order. Batch N+1 is prepared on the host
(scheduling, metadata, plans) while the GPU runs batch N, and its uploads queue behind N:
N+1 reads tokens N writes, and graph input buffers are shared by consecutive replays, so
stream order is what keeps them correct.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from asyncinfer.attention.base import AttentionContext
from asyncinfer.attention.flashinfer_backend import (
    FlashInferBackend,
    FlashInferMetadata,
    PagedLayout,
    load_flashinfer,
    paged_layout,
)
from asyncinfer.config import EngineConfig
from asyncinfer.core import Batch, ForwardOutput
from asyncinfer.engine.cuda_graph import DecodeGraphs
from asyncinfer.engine.runner import HostInputs, ModelRunner, host_inputs
from asyncinfer.engine.transfer import pin, upload
from asyncinfer.errors import ConfigError

logger = logging.getLogger(__name__)


class FlashInferRunner(ModelRunner):
    """ModelRunner with flashinfer attention, a host page table and an engine stream.

    One page beyond the scheduler's (``scratch_page``) takes the K, V of graph padding rows.
    """

    extra_pages = 1

    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        self.flashinfer = load_flashinfer(torch.device(config.device))
        if config.torch_dtype == torch.float32 and not getattr(
                self.flashinfer, "HAS_FLOAT32_KERNELS", False):
            raise ConfigError("flashinfer has no float32 kernels (its dtype maps hold fp16, "
                              "bf16 and fp8); use bfloat16 or float16, or "
                              "attention_backend='torch' for float32")
        super().__init__(config, model_dir)
        self.scratch_page = self.num_pages
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.graphs: DecodeGraphs | None = None
        if config.cuda_graph:
            max_bs = min(config.cuda_graph_max_bs or self.max_rows, self.max_rows)
            max_pages = max_bs * (self.width // self.page_size + 1)
            self.graphs = DecodeGraphs(
                self.backend, lambda ids, pos, attn: self.logits(self.model(ids, pos, attn)),
                self.token_pool, max_bs, max_pages, self.device)
            with self._on_stream():
                self.graphs.capture(self._dummy_layout)
        logger.info("flashinfer runner: %d KV pages of %d tokens (%d tokens); decode graphs "
                    "%s", self.num_pages, self.page_size, self.num_pages * self.page_size,
                    self.graphs.sizes if self.graphs else "off")

    @property
    def table_device(self) -> torch.device:
        return torch.device("cpu")

    def _make_backend(self) -> FlashInferBackend:
        cfg = self.model_config
        return FlashInferBackend(self.flashinfer, self.pool, cfg.num_heads, cfg.num_kv_heads,
                                 cfg.head_dim, cfg.head_dim**-0.5, self.dtype, self.device)

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def _dummy_layout(self, bs: int) -> PagedLayout:
        return paged_layout(self.page_table, [0], [1], self.page_size, pad_to=bs,
                            pad_page=self.scratch_page)

    def _staged(self, layout: PagedLayout) -> PagedLayout:
        """The layout as flashinfer's plan wants it without blocking: page indices already
        on the device (it copies host indices synchronously, which would wait for the batch
        in flight), the small arrays it reads on the host in pinned memory."""
        return PagedLayout(pin(layout.indptr, self.device), upload(layout.indices, self.device),
                           pin(layout.last_page_len, self.device),
                           pin(layout.seq_lens, self.device))

    def write_prompt(self, row: int, token_ids: Sequence[int]) -> None:
        """Upload a prompt into its token-pool row, in order on the engine stream."""
        with self._on_stream():
            ids = upload(torch.tensor(list(token_ids), dtype=torch.int64), self.device)
            self.token_pool[row, : len(token_ids)].copy_(ids)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def forward(self, batch: Batch) -> ForwardOutput:
        return self.launch(batch)()

    @torch.inference_mode()
    def launch(self, batch: Batch) -> Callable[[], ForwardOutput]:
        """Enqueue the batch; the returned call waits for its sampled tokens."""
        with self._on_stream():
            host = host_inputs(batch, self.width, self.max_rows)
            bs = self.graphs.pick(batch.size) if (
                self.graphs is not None and batch.phase == "decode") else None
            logits = (self._decode_graph(batch, host, bs) if bs is not None
                      else self._eager(batch, host))
            tokens = self.sampler.sample(logits, batch.params, batch.steps)
            self.token_pool.view(-1)[upload(host.write_index, self.device)] = tokens
            if self.stream is None:
                return lambda: ForwardOutput(tokens, logits)
            out = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            out.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)

        def wait() -> ForwardOutput:
            done.synchronize()
            return ForwardOutput(out, logits)

        return wait

    def _eager(self, batch: Batch, host: HostInputs) -> torch.Tensor:
        out_loc = self.page_table.view(-1)[host.input_index]
        layout = self._staged(paged_layout(self.page_table, batch.rows, batch.ends,
                                           self.page_size))
        if batch.phase == "decode":
            wrapper = self.backend.decode
            self.backend.plan_decode(wrapper, layout)
        else:
            wrapper = self.backend.prefill
            lens = torch.tensor([0, *batch.extend_lens], dtype=torch.int32)
            self.backend.plan_prefill(layout, pin(lens.cumsum(0, dtype=torch.int32),
                                                  self.device))
        packed = upload(torch.cat([host.input_index, host.positions, out_loc,
                                   host.last_index]), self.device)
        index, positions, out_loc_dev, last = packed.split(
            [len(host.positions)] * 3 + [batch.size])
        attn = AttentionContext(self.backend, FlashInferMetadata(wrapper, out_loc_dev))
        hidden = self.model(self.token_pool.view(-1)[index], positions, attn)
        return self.logits(hidden[last])

    def _decode_graph(self, batch: Batch, host: HostInputs, bs: int) -> torch.Tensor:
        assert self.graphs is not None
        n, pad = batch.size, bs - batch.size
        scratch_index = self.max_rows * self.width
        scratch_slot = self.scratch_page * self.page_size
        inputs = torch.stack([
            torch.cat([host.input_index, torch.full((pad,), scratch_index)]),
            torch.cat([host.positions, torch.zeros(pad, dtype=torch.int64)]),
            torch.cat([self.page_table.view(-1)[host.input_index],
                       torch.full((pad,), scratch_slot)])])
        layout = self._staged(paged_layout(self.page_table, batch.rows, batch.ends,
                                           self.page_size, pad_to=bs,
                                           pad_page=self.scratch_page))
        return self.graphs.run(bs, pin(inputs, self.device), layout)[:n]
