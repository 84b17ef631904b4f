"""The model runner: model, KV pool, page table and token pool; runs one Batch at a time,
enqueued on one engine stream on CUDA. See docs/architecture.md, 'The runner's stream'."""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import cast

import numpy as np
import torch
from attrs import frozen
from torch import nn

from asyncinfer.attention.base import AttentionContext, AttentionSpec
from asyncinfer.attention.host_to_device import upload
from asyncinfer.attention.registry import backend_class
from asyncinfer.config import EngineConfig, ModelConfig
from asyncinfer.core import Batch, ForwardOutput, TopLogprobs
from asyncinfer.distributed.parallel import TensorParallel
from asyncinfer.engine.cuda_graph import CudaGraphs, Graph
from asyncinfer.engine.grammar import Grammars
from asyncinfer.engine.invariant import batch_invariant, triton_invariant_path
from asyncinfer.engine.sampler import Sampler, device_tensor, top_logprobs
from asyncinfer.engine.warm_up import warm_up
from asyncinfer.errors import ConfigError
from asyncinfer.kernels import triton_invariant
from asyncinfer.kernels.cpu import NativeKernels
from asyncinfer.kernels.cpu import load as load_cpu_kernels
from asyncinfer.kvcache.pool import KVPool, cpu_kv_budget, is_fp8
from asyncinfer.layers.fused import INVARIANT_NORMS, LayerOps
from asyncinfer.layers.linear import can_pack
from asyncinfer.layers.packing import (
    pack_for_cpu,
    packs_every_weight,
    use_fp32_products,
    use_product,
    weight_bytes,
)
from asyncinfer.layers.rotary import RotaryEmbedding
from asyncinfer.memory import available_memory, return_free_heap
from asyncinfer.models import build_model, check_model
from asyncinfer.models.base import CausalLM
from asyncinfer.models.weights import init_dummy, iter_safetensors
from asyncinfer.threads import ThreadTuner, cpu_threads, threads_chosen

logger = logging.getLogger(__name__)


def _size(nbytes: float) -> str:
    """Bytes in MiB or, from 1 GiB, GiB."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def rank_device(device: str, rank: int) -> torch.device:
    """The device of tensor-parallel rank ``rank`` of a model on ``device``."""
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

    Invariants: ``token_pool[row, pos]`` (device) and ``page_table[row, pos]`` (host) are
    filled by the scheduler; ``scratch_page`` takes CUDA-graph padding's K, V; the token
    pool's last row takes the tokens nobody reads."""

    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        self.config = config
        self.tp = TensorParallel.join(config.tensor_parallel_size)
        self.device = rank_device(config.device, self.tp.rank)
        if self.device.index is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.cpu_threads = 0  # the threads this rank computes with, on a CPU (at most)
        self.thread_tuner: ThreadTuner | None = None
        if self.device.type == "cpu":
            self.cpu_threads = cpu_threads(config.cpu_threads, self.tp.size)
            torch.set_num_threads(self.cpu_threads)
            if self.cpu_threads > 1 and not threads_chosen(config.cpu_threads):
                self.thread_tuner = ThreadTuner(self.cpu_threads, torch.set_num_threads)
        self.dtype = config.torch_dtype
        backend_name = config.resolved_attention_backend
        backend_cls = backend_class(backend_name)
        backend_cls.check(self.device, self.dtype)  # before the time that loading takes
        self.model_config = ModelConfig.from_pretrained(model_dir)
        full = self.model_config
        self.context_len = config.context_len(full)
        check_model(full, self.context_len)
        # Dense and expert widths alike split over the ranks.
        self.tp.check(full.num_heads, full.num_kv_heads,
                      math.gcd(full.intermediate_size, full.moe_intermediate_size))
        self.shard_config = full.sharded(self.tp.size)
        kernels = (load_cpu_kernels() if self.device.type == "cpu" and config.cpu_kernels
                   else None)
        self.batch_invariant = batch_invariant(config, self.device, self.dtype, kernels,
                                               full.num_experts)
        self.model = self._load_model(model_dir, kernels)
        if self.thread_tuner is not None:  # a forward can take seconds: look between layers
            tuner = self.thread_tuner
            for layer in getattr(self.model, "layers", ()):
                layer.register_forward_pre_hook(lambda _module, _args: tuner.step())
        # Off the CPU, the mode's own Triton kernels: products, norms, attention, softmax.
        on_triton = self.batch_invariant and triton_invariant_path(self.device)
        if on_triton and self.model.op_names.norm not in INVARIANT_NORMS:
            raise ConfigError(f"batch_invariant has no kernel for the norm "
                              f"{self.model.op_names.norm!r} of this model")
        return_free_heap()
        # With float32 kernels the cache holds half-precision values in float32 (exactly).
        self.kv_dtype = config.kv_cache_torch_dtype or (
            torch.float32 if config.fp32_kernels else self.dtype)
        _check_fp8_device(self.kv_dtype, self.device, config.kv_cache_dtype)
        cfg, page = self.shard_config, config.page_size
        self.page_size = page
        extra_pages = 1 if backend_cls.capturable else 0
        self.num_pages = config.num_pages or self._pages_from_budget(extra_pages)
        self.scratch_page = self.num_pages if backend_cls.capturable else None
        self.pool = KVPool(cfg.num_layers, self.num_pages + extra_pages, page,
                           cfg.num_kv_heads, cfg.head_dim, self.kv_dtype, self.device)
        if on_triton:  # nothing compiled: elementwise torch around our kernels
            self.model.ops = LayerOps(self.model.op_names, invariant=True)
        elif config.compiles:
            logger.info("compiling the fused layer ops and the sampler with torch.compile")
            compile_start = time.perf_counter()
            self.compile_layer_ops()
        self.max_rows = config.max_running_requests
        # Whole pages per row, plus one column so a sampled token always has a place.
        self.width = -(-self.context_len // page) * page + 1
        self.page_table = torch.zeros(self.max_rows, self.width, dtype=torch.int64)
        # One row more than requests: tokens nobody reads (a mid-prompt chunk's) land there.
        self.token_pool = torch.zeros(self.max_rows + 1, self.width, dtype=torch.int64,
                                      device=self.device)
        self.backend = backend_cls(AttentionSpec(
            self.pool, self.page_table, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.attention_scale, self.dtype, self.device, self.scratch_page,
            native=config.cpu_kernels, windows=self.model.windows,
            invariant=self.batch_invariant))
        if kernels is not None and kernels.runs_layer_ops(self.dtype, cfg.hidden_size,
                                                          cfg.head_dim):
            self.model.ops = LayerOps(self.model.op_names, native=kernels,
                                      fp8_cache=is_fp8(self.kv_dtype))
        self.sampler = Sampler(config.seed, compile=config.compiles, device=self.device,
                               argmax=None if kernels is None else kernels.argmax,
                               invariant=on_triton,
                               race_fn=None if kernels is None else kernels.race,
                               noise_fn=None if kernels is None else kernels.gumbel_noise)
        self.sampler.warm_up(self.model_config.vocab_size, self.logits_dtype, self.device)
        self.grammars = Grammars(model_dir, self.model_config.vocab_size, native=kernels)
        if config.compiles and not on_triton:
            logger.info("compiled with torch.compile in %.1f s",
                        time.perf_counter() - compile_start)
        self.stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.graphs: CudaGraphs | None = None
        if config.cuda_graph and backend_cls.capturable:
            assert self.scratch_page is not None
            self.graphs = CudaGraphs(
                self.backend, self.forward_logits, self.token_pool,
                min(config.cuda_graph_max_bs or self.max_rows, self.max_rows),
                min(config.cuda_graph_max_prefill_tokens, config.max_extend_tokens),
                pad_index=self.max_rows * self.width, pad_slot=self.scratch_page * page,
                device=self.device)
            if self.stream is not None:  # nothing is captured off CUDA
                with torch.cuda.stream(self.stream):
                    self.graphs.capture()
        weights = weight_bytes(cast(nn.Module, self.model))
        logger.info("%sweights %s; KV cache: %d pages of %d tokens (%d tokens, %s; "
                    "kv_cache_gb or num_pages sets it)%s; %s attention, CUDA graphs: "
                    "decode %s, prefill %s",
                    f"rank {self.tp.rank} of {self.tp.size} on {self.device}: "
                    if self.tp.size > 1 else "", _size(weights), self.num_pages, page,
                    self.num_pages * page,
                    _size(self.num_pages * page * cfg.kv_bytes_per_token(self.kv_dtype))
                    + (f" in {config.kv_cache_dtype}" if is_fp8(self.kv_dtype) else ""),
                    ("; float32 kernels for half-precision values" if config.fp32_kernels
                     else "") + (f"; {self.cpu_threads} CPU threads (cpu_threads sets "
                                 "them)" if self.cpu_threads else ""), backend_name,
                    self.graphs.decode_sizes if self.graphs else "off",
                    (self.graphs.prefill_sizes or "off") if self.graphs else "off")
        if self.device.type == "cpu" and config.warm_up and self.graphs is None:
            warm_up(self, config.max_extend_tokens)

    def release_graphs(self) -> None:
        """Drop the captured CUDA graphs and what they hold (the engine is stopping)."""
        if self.graphs is None:
            return
        graphs, self.graphs = self.graphs, None
        if self.stream is not None:
            self.stream.synchronize()
        graphs.release()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def compile_layer_ops(self, backend: str = "inductor") -> None:
        """Run the model's layer ops through torch.compile, compiled now (pool still empty)."""
        self.model.ops = LayerOps(self.model.op_names, compile=True, backend=backend,
                                  device=self.pool.k.device, fp8_cache=is_fp8(self.kv_dtype))
        self.model.ops.warm_up(self.model.warm_up_args(), self.rotary, self.pool.k[0],
                               self.pool.v[0])

    @property
    def logits_dtype(self) -> torch.dtype:
        """What the sampler gets: float32, or the model's dtype for a compiled sampler."""
        return self.dtype if self.config.compiles else torch.float32

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits for ``hidden``, in ``logits_dtype``."""
        return self.model.compute_logits(hidden, upcast=self.logits_dtype == torch.float32)

    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       attn: AttentionContext, last: torch.Tensor | None) -> torch.Tensor:
        """The logits of the tokens at ``last`` (all when None): what graphs capture."""
        hidden = self.model(input_ids, positions, attn)
        return self.logits(hidden if last is None else hidden[last])

    def _load_model(self, model_dir: Path, kernels: NativeKernels | None) -> CausalLM:
        cfg = self.shard_config
        self.rotary = RotaryEmbedding(cfg.hf_config, cfg.head_dim, self.context_len + 1,
                                      self.device)
        with torch.device("meta"):
            model = build_model(cfg, self.rotary, self.tp)
        module = cast(nn.Module, model)
        if self.config.load_format == "dummy":  # made where it runs: no host copy of it
            module.to_empty(device=self.device).requires_grad_(False)
            module.to(dtype=self.dtype)
            init_dummy(module, self.config.seed)
        else:
            module.to_empty(device="cpu").requires_grad_(False)
            model.load_weights(iter_safetensors(model_dir, model.rank_part))
        module.to(device=self.device, dtype=self.dtype).eval()
        if self.batch_invariant and triton_invariant_path(self.device):
            use_product(module, triton_invariant.linear)
        elif self.config.fp32_kernels and not self.batch_invariant:
            use_fp32_products(module, kernels)
        elif self.device.type == "cpu" and (can_pack(self.dtype) or self.batch_invariant):
            # The mode multiplies through our kernels, the AVX2 one included (the
            # arithmetic of the float32 shadows: bf16 in, float32 sums, rounded once).
            ours = kernels if kernels is not None and (
                kernels.products or (self.batch_invariant and kernels.fixed_products)) else None
            if (self.batch_invariant and self.config.batch_invariant is None
                    and not packs_every_weight(module, ours)):
                self.batch_invariant = False  # the default: on only where it holds
            pack_for_cpu(module, self.config.max_running_requests, ours,
                         every_size=self.batch_invariant)
        return model

    def _pages_from_budget(self, extra_pages: int) -> int:
        per_page = self.shard_config.kv_bytes_per_token(self.kv_dtype) * self.page_size
        if self.config.kv_cache_gb is not None:
            budget = int(self.config.kv_cache_gb * 2**30)
        elif self.device.type == "cuda":
            budget = cuda_kv_budget(self.device, self.config.gpu_memory_utilization)
        else:
            budget = cpu_kv_budget(self.shard_config.kv_bytes_per_token(self.kv_dtype),
                                   self.context_len, self.config.max_running_requests,
                                   available_memory())
        return max(1, budget // per_page - extra_pages)

    def write_prompt(self, row: int, token_ids: Sequence[int]) -> None:
        """Put a newly admitted request's prompt into its token-pool row (non-blocking)."""
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
            # Spans between these events add up to the device's busy time.
            start = torch.cuda.Event(enable_timing=True)
            run = self._enqueue(batch, lambda: start.record(self.stream))
            # Logprobs ride to the host in the same copy as the tokens, before one event.
            out, logprobs, prompt = (_to_pinned(run.tokens), _pinned(run.logprobs),
                                     _pinned(run.prompt_logprobs))
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.stream)

        def wait() -> ForwardOutput:
            done.synchronize()
            return ForwardOutput(out, run.logits, start.elapsed_time(done) / 1000,
                                 logprobs, prompt)

        return wait

    @torch.inference_mode()
    def _forward_here(self, batch: Batch) -> ForwardOutput:
        if self.thread_tuner is not None:
            self.thread_tuner.step()
        run = self._enqueue(batch)
        return ForwardOutput(run.tokens, run.logits, 0.0, run.logprobs, run.prompt_logprobs)

    def _enqueue(self, batch: Batch, computing: Callable[[], None] | None = None) -> _Run:
        """Run the batch on the current stream: its sampled tokens [B], logits and the
        logprobs asked for (``computing``: called once the inputs are staged). A batch that
        scores prompt positions runs eagerly: a graph computes the last positions only."""
        host = host_inputs(batch, self.width, self.max_rows)
        scores = scored_inputs(batch, host) if batch.scored and any(batch.scored) else None
        graph = None if self.graphs is None or scores is not None else self.graphs.pick(
            batch.phase, batch.size, len(host.positions))
        prompt_logprobs = None
        if graph is None:
            logits, scored_logits, targets = self._eager(batch, host, scores, computing)
            if scored_logits is not None:
                assert targets is not None and batch.scored is not None
                k = max(p.prompt_logprobs or 0 for p, n in zip(batch.params, batch.scored)
                        if n)
                prompt_logprobs = TopLogprobs(*top_logprobs(
                    self.sampler.log_softmax(scored_logits), self.token_pool.view(-1)[targets],
                    k))
        else:
            logits = self._replay(batch, host, graph, computing)
        # Before sampling: the raw distribution, whatever the sampler does to the logits.
        wanted = [i for i, (p, s) in enumerate(zip(batch.params, batch.sample))
                  if s and p.logprobs is not None]
        raw, index = None, None
        if wanted:
            if len(wanted) < batch.size:
                index = device_tensor(wanted, torch.int64, self.device)
            raw = self.sampler.log_softmax(logits if index is None else logits[index])
        adjusted = self.sampler.adjust(logits, batch, self.token_pool)
        constrained = self.grammars.constrained(batch)
        if constrained:
            adjusted = self.grammars.mask(adjusted, batch, constrained, self.token_pool,
                                          raw=adjusted is logits)
        tokens = self.sampler.sample(adjusted, batch.params, batch.steps)
        if constrained:
            self.grammars.record(tokens, batch, constrained, self.stream)
        self.token_pool.view(-1)[upload(host.write_index, self.device)] = tokens
        logprobs = None
        if raw is not None:
            k = max(batch.params[i].logprobs or 0 for i in wanted)
            logprobs = TopLogprobs(*top_logprobs(
                raw, tokens if index is None else tokens[index], k))
        return _Run(tokens, logits, logprobs, prompt_logprobs)

    def _eager(self, batch: Batch, host: HostInputs,
               scores: tuple[torch.Tensor, torch.Tensor] | None,
               computing: Callable[[], None] | None
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The logits of each request's last position, then those of the scored positions
        and the flat token-pool index of the token each scores (None, None: none scored)."""
        out_loc = self.page_table.view(-1)[host.input_index]
        parts = [host.input_index, host.positions, out_loc, host.last_index]
        sizes = [len(host.positions)] * 3 + [batch.size]
        if scores is not None:
            parts += list(scores)
            sizes += [len(scores[0])] * 2
        split = upload(torch.cat(parts), self.device).split(sizes)
        index, positions, out_loc_dev, last = split[:4]
        if scores is not None:
            last = torch.cat([last, split[4]])
        attn = AttentionContext(self.backend, self.backend.plan(batch, out_loc_dev))
        if computing is not None:
            computing()
        logits = self.forward_logits(self.token_pool.view(-1)[index], positions, attn, last)
        if scores is None:
            return logits, None, None
        return logits[: batch.size], logits[batch.size :], split[5]

    def _replay(self, batch: Batch, host: HostInputs, graph: Graph,
                computing: Callable[[], None] | None) -> torch.Tensor:
        assert self.graphs is not None
        inputs = torch.stack([host.input_index, host.positions,
                              self.page_table.view(-1)[host.input_index]])
        return self.graphs.run(graph, batch, inputs, host.last_index, computing)


@frozen
class _Run:
    """A batch enqueued: its tokens, logits and the logprobs asked for (on the device)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    logprobs: TopLogprobs | None
    prompt_logprobs: TopLogprobs | None


def _to_pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a device tensor, enqueued on the current stream."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    out.copy_(tensor, non_blocking=True)
    return out


def _pinned(logprobs: TopLogprobs | None) -> TopLogprobs | None:
    return None if logprobs is None else TopLogprobs(_to_pinned(logprobs.values),
                                                     _to_pinned(logprobs.ids))


@frozen
class HostInputs:
    """Per-token and per-request indices of one batch, built on the host (int64)."""

    input_index: torch.Tensor   # [T] flat token-pool index of each computed token
    positions: torch.Tensor     # [T] its position in its sequence
    last_index: torch.Tensor    # [B] each request's last computed token, in T
    write_index: torch.Tensor   # [B] flat token-pool index of the sampled token


def host_inputs(batch: Batch, width: int, scratch_row: int) -> HostInputs:
    """The batch's indices, vectorised; a request that samples nothing writes to
    ``scratch_row``."""
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


def scored_inputs(batch: Batch, host: HostInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``batch.scored``'s positions are among the computed tokens [P], and the flat
    token-pool index of the token after each [P]: the prompt token it scores."""
    assert batch.scored is not None
    lens = np.asarray(batch.extend_lens, np.int64)
    counts = np.asarray(batch.scored, np.int64)
    owner = np.repeat(np.arange(batch.size), counts)
    within = np.arange(int(counts.sum())) - (np.cumsum(counts) - counts)[owner]
    at = (np.cumsum(lens) - lens)[owner] + within
    return torch.from_numpy(at), host.input_index[torch.from_numpy(at)] + 1


def cuda_kv_budget(device: torch.device, utilization: float) -> int:
    """Bytes the KV pool may take: the engine's share of the device, less what is in use
    and a reserve for activations, graphs and workspace."""
    free, total = torch.cuda.mem_get_info(device)
    reserve = max(2 * 2**30, int(0.05 * total))
    budget = int(total * utilization) - (total - free) - reserve
    if budget <= 0:
        raise ConfigError(
            f"no GPU memory left for the KV cache: {free / 2**30:.1f} GiB free of "
            f"{total / 2**30:.1f} GiB at gpu_memory_utilization={utilization}; raise it or "
            "set kv_cache_gb")
    return budget


def _check_fp8_device(kv_dtype: torch.dtype, device: torch.device, name: str) -> None:
    """An FP8 cache on a GPU needs SM 8.9 or later: the stores' Triton code casts to FP8,
    which Triton compiles for no earlier GPU."""
    if is_fp8(kv_dtype) and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ConfigError(f"kv_cache_dtype {name!r} needs a GPU of compute capability "
                              f"8.9 or later (Ada, Hopper, Blackwell); {device} is "
                              f"{major}.{minor}: use kv_cache_dtype 'auto'")
