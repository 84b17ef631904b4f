"""The model runner: model, KV pool, page table and token pool; runs one Batch at a time."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from attrs import frozen

from asyncinfer.attention.base import AttentionContext
from asyncinfer.attention.torch_backend import TorchBackend
from asyncinfer.config import EngineConfig, ModelConfig
from asyncinfer.core import Batch, ForwardOutput
from asyncinfer.engine.sampler import Sampler
from asyncinfer.errors import ConfigError
from asyncinfer.kvcache.pool import KVPool
from asyncinfer.layers.rotary import RotaryEmbedding
from asyncinfer.models import build_model
from asyncinfer.models.llama import LlamaForCausalLM
from asyncinfer.models.weights import init_dummy, iter_safetensors

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the device-side state of a model and runs forwards over it.

    ``token_pool[row, pos]`` holds each request's token ids and ``page_table[row, pos]`` the
    KV slot of each position; the scheduler fills both, the runner reads them.
    """

    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.model_config = ModelConfig.from_pretrained(model_dir)
        self.context_len = config.context_len(self.model_config)
        self.model = self._load_model(model_dir)
        # With float32 kernels the cache holds half-precision values in float32 (exactly).
        self.kv_dtype = torch.float32 if config.fp32_kernels else self.dtype
        cfg, page = self.model_config, config.page_size
        self.page_size = page
        self.num_pages = config.num_pages or self._pages_from_budget()
        self.pool = KVPool(cfg.num_layers, self.num_pages + self.extra_pages, page,
                           cfg.num_kv_heads, cfg.head_dim, self.kv_dtype, self.device)
        if config.compiles:
            self.model.compile_layer_ops(self.pool)
        self.max_rows = config.max_running_requests
        # Whole pages per row, plus one column so a sampled token always has a place.
        self.width = -(-self.context_len // page) * page + 1
        self.page_table = torch.zeros(self.max_rows, self.width, dtype=torch.int64,
                                      device=self.table_device)
        # One row more than requests: tokens nobody reads (a mid-prompt chunk's) land there.
        self.token_pool = torch.zeros(self.max_rows + 1, self.width, dtype=torch.int64,
                                      device=self.device)
        self.backend = self._make_backend()
        self.sampler = Sampler(config.seed, compile=config.compiles, device=self.device)
        self.sampler.warm_up(self.model_config.vocab_size, self.logits_dtype, self.device)
        logger.info("KV cache: %d pages of %d tokens (%d tokens, %.2f GiB)%s", self.num_pages,
                    page, self.num_pages * page,
                    self.num_pages * page * cfg.kv_bytes_per_token(self.kv_dtype) / 2**30,
                    "; float32 kernels for half-precision values" if config.fp32_kernels
                    else "")

    @property
    def logits_dtype(self) -> torch.dtype:
        """What the sampler gets: float32, or the model's dtype where a compiled sampler
        widens the logits itself as it reads them (one pass less over [B, vocab])."""
        return self.dtype if self.config.compiles else torch.float32

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits for ``hidden``, in ``logits_dtype``."""
        return self.model.compute_logits(hidden, upcast=self.logits_dtype == torch.float32)

    # Hooks a subclass for another attention backend overrides.
    extra_pages = 0                                   # pages beyond those the scheduler owns

    @property
    def table_device(self) -> torch.device:
        """Where the page table lives (the torch backend indexes it on the model's device)."""
        return self.device

    def _make_backend(self) -> Any:
        return TorchBackend(self.pool, self.page_table, self.model_config.head_dim**-0.5)

    def _load_model(self, model_dir: Path) -> LlamaForCausalLM:
        cfg = self.model_config
        rotary = RotaryEmbedding(cfg.hf_config, cfg.head_dim, self.context_len + 1, self.device)
        # Build on the meta device so no time goes into an initialisation we overwrite.
        with torch.device("meta"):
            model = build_model(cfg, rotary)
        model = model.to_empty(device="cpu").requires_grad_(False)
        if self.config.load_format == "dummy":
            init_dummy(model, self.config.seed)
        else:
            model.load_weights(iter_safetensors(model_dir))
        model.to(device=self.device, dtype=self.dtype).eval()
        if self.config.fp32_kernels:
            model.use_fp32_shadow()
        return model

    def _pages_from_budget(self) -> int:
        per_page = self.model_config.kv_bytes_per_token(self.kv_dtype) * self.page_size
        if self.config.kv_cache_gb is not None:
            budget = int(self.config.kv_cache_gb * 2**30)
        elif self.device.type == "cuda":
            budget = cuda_kv_budget(self.device, self.config.gpu_memory_utilization)
        else:
            budget = 2 * 2**30
        return max(1, budget // per_page - self.extra_pages)

    def write_prompt(self, row: int, token_ids: Sequence[int]) -> None:
        """Put a newly admitted request's prompt into its token-pool row."""
        self.token_pool[row, : len(token_ids)] = torch.tensor(list(token_ids)).to(self.device)

    def launch(self, batch: Batch) -> Callable[[], ForwardOutput]:
        """Start a batch; calling the result waits for it and returns its tokens.

        Here the whole forward runs inside the returned call (the coordinator makes it in a
        worker thread); the CUDA runner enqueues the work at once and only waits there.
        """
        return partial(self.forward, batch)

    def synchronize(self) -> None:
        """Wait until nothing launched is still running on the device."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def forward(self, batch: Batch) -> ForwardOutput:
        """Compute the batch's new tokens, sample one token per request, write it back."""
        host = host_inputs(batch, self.width, self.max_rows)
        index = host.input_index.to(self.device)
        positions = host.positions.to(self.device)
        input_ids = self.token_pool.view(-1)[index]
        attn = AttentionContext(self.backend,
                                self.backend.prepare(batch, index // self.width, positions))
        hidden = self.model(input_ids, positions, attn)
        logits = self.logits(hidden[host.last_index.to(self.device)])
        next_tokens = self.sampler.sample(logits, batch.params, batch.steps)
        self.token_pool.view(-1)[host.write_index.to(self.device)] = next_tokens
        return ForwardOutput(next_tokens.cpu(), logits)


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
