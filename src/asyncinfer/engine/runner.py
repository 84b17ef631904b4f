"""The model runner: model, KV pool, page table and token pool; runs one Batch at a time.

``launch(batch)`` builds the batch's indices on the host (the page table lives there, the
scheduler fills it), has the attention backend plan the batch, runs the model, samples, and
writes the sampled ids into the token pool. With a capturable backend, a batch that fits a
captured CUDA graph (``engine.cuda_graph``: decode batches up to ``cuda_graph_max_bs``
requests, prefill and mixed batches up to ``cuda_graph_max_prefill_tokens`` tokens) replays
it, padded, instead: one launch for the whole model, where an eager forward launches every
layer's kernels from Python. Either way the forward ends with the logits of each request's
last token, and sampling runs eagerly after it.

On CUDA all of it is enqueued at once, on the coordinator's thread, onto one engine stream:
inputs are uploaded from pinned memory with non-blocking copies, the sampled tokens start a
non-blocking copy into pinned host memory, and an event is recorded. The returned ``wait``
blocks on that event, in the coordinator's waiter thread: that copy is the one host
synchronisation of a step. Batch N+1 is prepared on the host (scheduling, metadata, plans)
while the GPU runs batch N, and its uploads queue behind N: N+1 reads tokens N writes, and
graph input buffers and the backend's graph layout are shared by consecutive replays, so
stream order keeps them correct.

Off CUDA there is nothing to enqueue onto: the whole forward runs inside the returned call
(the coordinator makes it in a worker thread).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import numpy as np
import torch
from attrs import frozen

from asyncinfer.attention.base import AttentionContext, AttentionSpec
from asyncinfer.attention.host_to_device import upload
from asyncinfer.attention.registry import backend_class
from asyncinfer.config import EngineConfig, ModelConfig
from asyncinfer.core import Batch, ForwardOutput
from asyncinfer.distributed.parallel import TensorParallel
from asyncinfer.engine.cuda_graph import CudaGraphs, Graph
from asyncinfer.engine.sampler import Sampler
from asyncinfer.errors import ConfigError
from asyncinfer.kernels.cpu import NativeKernels
from asyncinfer.kernels.cpu import load as load_cpu_kernels
from asyncinfer.kvcache.pool import KVPool
from asyncinfer.layers.fused import LayerOps
from asyncinfer.layers.linear import can_pack
from asyncinfer.layers.rotary import RotaryEmbedding
from asyncinfer.models import build_model
from asyncinfer.models.llama import LlamaForCausalLM
from asyncinfer.models.weights import init_dummy, iter_safetensors

logger = logging.getLogger(__name__)


def _size(nbytes: float) -> str:
    """Bytes in MiB or, from 1 GiB, GiB."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def rank_device(device: str, rank: int) -> torch.device:
    """The device of tensor-parallel rank ``rank`` of a model placed on ``device``: the
    same CPU, or the ``rank``-th CUDA device from the one named."""
    base = torch.device(device)
    if base.type != "cuda" or rank == 0:
        return base
    index = (base.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ConfigError(f"tensor-parallel rank {rank} needs CUDA device {index}; this "
                          f"machine has {torch.cuda.device_count()}")
    return torch.device("cuda", index)


class ModelRunner:
    """Owns the device-side state of a model and runs forwards over it.

    ``token_pool[row, pos]`` (on the device) holds each request's token ids and
    ``page_table[row, pos]`` (on the host) the KV slot of each position; the scheduler fills
    both, the runner reads them. The attention backend is ``config``'s, from the registry.
    A backend that can be captured gets one page beyond the scheduler's (``scratch_page``),
    which takes the K, V of CUDA-graph padding; the token pool's last row (``max_rows``)
    takes the tokens nobody reads, and its first token is what padding tokens read.
    """

    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        self.config = config
        # This rank's share of the model (all of it without tensor parallelism), on its
        # own device: rank r of a model on cuda:i runs on cuda:i+r.
        self.tp = TensorParallel.join(config.tensor_parallel_size)
        self.device = rank_device(config.device, self.tp.rank)
        if self.device.index is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu" and self.tp.size > 1:
            # The ranks share the machine's cores: each takes its share, not all of them.
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
                os.cpu_count() or 1)
            torch.set_num_threads(max(1, cores // self.tp.size))
        self.dtype = config.torch_dtype
        backend_name = config.resolved_attention_backend
        backend_cls = backend_class(backend_name)
        backend_cls.check(self.device, self.dtype)  # before the time that loading takes
        self.model_config = ModelConfig.from_pretrained(model_dir)
        full = self.model_config
        self.tp.check(full.num_heads, full.num_kv_heads, full.intermediate_size)
        self.shard_config = full.sharded(self.tp.size)
        self.context_len = config.context_len(self.model_config)
        kernels = (load_cpu_kernels() if self.device.type == "cpu" and config.cpu_kernels
                   else None)
        self.model = self._load_model(model_dir, kernels)
        # With float32 kernels the cache holds half-precision values in float32 (exactly).
        self.kv_dtype = torch.float32 if config.fp32_kernels else self.dtype
        cfg, page = self.shard_config, config.page_size
        self.page_size = page
        extra_pages = 1 if backend_cls.capturable else 0
        self.num_pages = config.num_pages or self._pages_from_budget(extra_pages)
        self.scratch_page = self.num_pages if backend_cls.capturable else None
        self.pool = KVPool(cfg.num_layers, self.num_pages + extra_pages, page,
                           cfg.num_kv_heads, cfg.head_dim, self.kv_dtype, self.device)
        if config.compiles:
            # Compiling takes a while at start: say so before, and how long it took once
            # the sampler's warm-up below has compiled too.
            logger.info("compiling the fused layer ops and the sampler with torch.compile")
            compile_start = time.perf_counter()
            self.model.compile_layer_ops(self.pool)
        self.max_rows = config.max_running_requests
        # Whole pages per row, plus one column so a sampled token always has a place.
        self.width = -(-self.context_len // page) * page + 1
        self.page_table = torch.zeros(self.max_rows, self.width, dtype=torch.int64)
        # One row more than requests: tokens nobody reads (a mid-prompt chunk's) land there.
        self.token_pool = torch.zeros(self.max_rows + 1, self.width, dtype=torch.int64,
                                      device=self.device)
        self.backend = backend_cls(AttentionSpec(
            self.pool, self.page_table, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.head_dim**-0.5, self.dtype, self.device, self.scratch_page,
            native=config.cpu_kernels))
        if kernels is not None and kernels.runs_layer_ops(self.dtype, cfg.hidden_size,
                                                          cfg.head_dim):
            self.model.ops = LayerOps(native=kernels)
        self.sampler = Sampler(config.seed, compile=config.compiles, device=self.device,
                               argmax=None if kernels is None else kernels.argmax)
        self.sampler.warm_up(self.model_config.vocab_size, self.logits_dtype, self.device)
        if config.compiles:
            logger.info("compiled with torch.compile in %.1f s",
                        time.perf_counter() - compile_start)
        self.stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
            # What the set-up queued (the pool's zeros, ...) comes before anything launched.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.graphs: CudaGraphs | None = None
        if config.cuda_graph and backend_cls.capturable:
            assert self.scratch_page is not None
            # A prefill batch never holds more tokens than a round's budget.
            self.graphs = CudaGraphs(
                self.backend, self.forward_logits, self.token_pool,
                min(config.cuda_graph_max_bs or self.max_rows, self.max_rows),
                min(config.cuda_graph_max_prefill_tokens, config.max_extend_tokens),
                pad_index=self.max_rows * self.width, pad_slot=self.scratch_page * page,
                device=self.device)
            if self.stream is not None:  # nothing is captured off CUDA
                with torch.cuda.stream(self.stream):
                    self.graphs.capture()
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        logger.info("%sweights %s; KV cache: %d pages of %d tokens (%d tokens, %s)"
                    "%s; %s attention, CUDA graphs: decode %s, prefill %s",
                    f"rank {self.tp.rank} of {self.tp.size} on {self.device}: "
                    if self.tp.size > 1 else "", _size(weights), self.num_pages, page,
                    self.num_pages * page,
                    _size(self.num_pages * page * cfg.kv_bytes_per_token(self.kv_dtype)),
                    "; float32 kernels for half-precision values" if config.fp32_kernels
                    else "", backend_name,
                    self.graphs.decode_sizes if self.graphs else "off",
                    (self.graphs.prefill_sizes or "off") if self.graphs else "off")

    def release_graphs(self) -> None:
        """Drop the captured CUDA graphs (the engine is stopping; eager forwards remain):
        what they captured, tensor-parallel collectives included, is freed now."""
        if self.graphs is None:
            return
        graphs, self.graphs = self.graphs, None
        if self.stream is not None:
            self.stream.synchronize()
        graphs.release()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def logits_dtype(self) -> torch.dtype:
        """What the sampler gets: float32, or the model's dtype where a compiled sampler
        widens the logits itself as it reads them (one pass less over [B, vocab])."""
        return self.dtype if self.config.compiles else torch.float32

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits for ``hidden``, in ``logits_dtype``."""
        return self.model.compute_logits(hidden, upcast=self.logits_dtype == torch.float32)

    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       attn: AttentionContext, last: torch.Tensor | None) -> torch.Tensor:
        """The model over these tokens, then the logits of those at ``last`` (of all when
        None): the forward that eager batches run and graphs capture."""
        hidden = self.model(input_ids, positions, attn)
        return self.logits(hidden if last is None else hidden[last])

    def _load_model(self, model_dir: Path, kernels: NativeKernels | None) -> LlamaForCausalLM:
        cfg = self.shard_config
        rotary = RotaryEmbedding(cfg.hf_config, cfg.head_dim, self.context_len + 1, self.device)
        # Build on the meta device so no time goes into an initialisation we overwrite.
        with torch.device("meta"):
            model = build_model(cfg, rotary, self.tp)
        model = model.to_empty(device="cpu").requires_grad_(False)
        if self.config.load_format == "dummy":
            init_dummy(model, self.config.seed)
        else:
            model.load_weights(iter_safetensors(model_dir, model.rank_part))
        model.to(device=self.device, dtype=self.dtype).eval()
        if self.config.fp32_kernels:
            model.use_fp32_shadow()
        elif self.device.type == "cpu" and can_pack(self.dtype):
            # Our product kernel where one builds (see layers.linear).
            model.pack_for_cpu(self.config.max_running_requests,
                               kernels if kernels is not None and kernels.products else None)
        return model

    def _pages_from_budget(self, extra_pages: int) -> int:
        per_page = self.shard_config.kv_bytes_per_token(self.kv_dtype) * self.page_size
        if self.config.kv_cache_gb is not None:
            budget = int(self.config.kv_cache_gb * 2**30)
        elif self.device.type == "cuda":
            budget = cuda_kv_budget(self.device, self.config.gpu_memory_utilization)
        else:
            budget = 2 * 2**30
        return max(1, budget // per_page - extra_pages)

    def write_prompt(self, row: int, token_ids: Sequence[int]) -> None:
        """Put a newly admitted request's prompt into its token-pool row (on CUDA: in order
        on the engine stream, without blocking)."""
        ids = torch.tensor(list(token_ids), dtype=torch.int64)
        if self.stream is None:
            self.token_pool[row, : len(ids)] = ids
            return
        with torch.cuda.stream(self.stream):
            self.token_pool[row, : len(ids)].copy_(upload(ids, self.device))

    def synchronize(self) -> None:
        """Wait until nothing launched is still running on the device."""
        if self.stream is not None:
            self.stream.synchronize()

    def forward(self, batch: Batch) -> ForwardOutput:
        """Compute the batch's new tokens, sample one token per request, write it back."""
        return self.launch(batch)()

    @torch.inference_mode()
    def launch(self, batch: Batch) -> Callable[[], ForwardOutput]:
        """Start a batch; calling the result waits for it and returns its tokens."""
        if self.stream is None:
            return partial(self._forward_here, batch)
        with torch.cuda.stream(self.stream):
            # Timed events around the batch's compute (recorded once its inputs are staged):
            # the stream reaches ``start`` no sooner than the batch before is done, so the
            # spans add up to the device's busy time without overlap. An eager batch's span
            # also holds the gaps between its kernels' launches.
            start = torch.cuda.Event(enable_timing=True)
            tokens, logits = self._enqueue(batch, lambda: start.record(self.stream))
            out = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            out.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.stream)

        def wait() -> ForwardOutput:
            done.synchronize()
            return ForwardOutput(out, logits, start.elapsed_time(done) / 1000)

        return wait

    @torch.inference_mode()
    def _forward_here(self, batch: Batch) -> ForwardOutput:
        return ForwardOutput(*self._enqueue(batch))

    def _enqueue(self, batch: Batch, computing: Callable[[], None] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the batch on the current stream: its sampled tokens [B] and logits.
        ``computing`` is called once the inputs are staged, before the model runs."""
        host = host_inputs(batch, self.width, self.max_rows)
        graph = None if self.graphs is None else self.graphs.pick(
            batch.phase, batch.size, len(host.positions))
        logits = (self._eager(batch, host, computing) if graph is None
                  else self._replay(batch, host, graph, computing))
        tokens = self.sampler.sample(logits, batch.params, batch.steps)
        self.token_pool.view(-1)[upload(host.write_index, self.device)] = tokens
        return tokens, logits

    def _eager(self, batch: Batch, host: HostInputs,
               computing: Callable[[], None] | None) -> torch.Tensor:
        out_loc = self.page_table.view(-1)[host.input_index]
        packed = upload(torch.cat([host.input_index, host.positions, out_loc,
                                   host.last_index]), self.device)
        index, positions, out_loc_dev, last = packed.split(
            [len(host.positions)] * 3 + [batch.size])
        attn = AttentionContext(self.backend, self.backend.plan(batch, out_loc_dev))
        if computing is not None:
            computing()
        return self.forward_logits(self.token_pool.view(-1)[index], positions, attn, last)

    def _replay(self, batch: Batch, host: HostInputs, graph: Graph,
                computing: Callable[[], None] | None) -> torch.Tensor:
        assert self.graphs is not None
        inputs = torch.stack([host.input_index, host.positions,
                              self.page_table.view(-1)[host.input_index]])
        return self.graphs.run(graph, batch, inputs, host.last_index, computing)


@frozen
class HostInputs:
    """Per-token and per-request indices of one batch, built on the host (int64)."""

    input_index: torch.Tensor   # [T] flat token-pool index of each computed token
    positions: torch.Tensor     # [T] its position in its sequence
    last_index: torch.Tensor    # [B] each request's last computed token, in T
    write_index: torch.Tensor   # [B] flat token-pool index of the sampled token


def host_inputs(batch: Batch, width: int, scratch_row: int) -> HostInputs:
    """Vectorised over the batch (numpy: a few array ops instead of a loop per request).

    A request that samples nothing this round (a mid-prompt chunk) writes to ``scratch_row``.
    """
    lens = np.fromiter((e - s for s, e in zip(batch.starts, batch.ends)), np.int64,
                       batch.size)
    starts, rows = np.asarray(batch.starts, np.int64), np.asarray(batch.rows, np.int64)
    ends = np.asarray(batch.ends, np.int64)
    if batch.phase == "decode":  # one token each: no ragged expansion needed
        positions, input_index, last = starts, rows * width + starts, np.arange(batch.size)
    else:
        offsets = np.cumsum(lens) - lens
        owner = np.repeat(np.arange(batch.size), lens)
        positions = np.arange(int(lens.sum())) - offsets[owner] + starts[owner]
        input_index, last = rows[owner] * width + positions, offsets + lens - 1
    write = np.where(np.asarray(batch.sample), rows * width + ends, scratch_row * width)
    return HostInputs(*(torch.from_numpy(np.ascontiguousarray(a, np.int64))
                        for a in (input_index, positions, last, write)))


def cuda_kv_budget(device: torch.device, utilization: float) -> int:
    """Bytes the KV pool may take: the share of the device the engine may hold, less what is
    in use now (weights, other processes) and a reserve for activations, graphs, workspace."""
    free, total = torch.cuda.mem_get_info(device)
    reserve = max(2 * 2**30, int(0.05 * total))
    budget = int(total * utilization) - (total - free) - reserve
    if budget <= 0:
        raise ConfigError(
            f"no GPU memory left for the KV cache: {free / 2**30:.1f} GiB free of "
            f"{total / 2**30:.1f} GiB at gpu_memory_utilization={utilization}; raise it or "
            "set kv_cache_gb")
    return budget
