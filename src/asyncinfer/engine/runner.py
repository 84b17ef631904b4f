"""The model runner: model, KV pool, page table and token pool; runs one Batch at a time."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from attrs import frozen

from asyncinfer.attention.base import AttentionContext
from asyncinfer.attention.torch_backend import TorchBackend
from asyncinfer.config import EngineConfig, ModelConfig
from asyncinfer.engine.batch import Batch
from asyncinfer.engine.sampler import Sampler
from asyncinfer.kvcache.pool import KVPool
from asyncinfer.layers.rotary import RotaryEmbedding
from asyncinfer.models import build_model
from asyncinfer.models.llama import LlamaForCausalLM
from asyncinfer.models.weights import init_dummy, iter_safetensors

logger = logging.getLogger(__name__)


@frozen
class ForwardOutput:
    """Sampled token per request (CPU), and the float32 logits they came from."""

    next_tokens: torch.Tensor
    logits: torch.Tensor


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
        self.num_pages = config.num_pages or self._pages_from_budget()
        cfg, page = self.model_config, config.page_size
        self.pool = KVPool(cfg.num_layers, self.num_pages, page, cfg.num_kv_heads,
                           cfg.head_dim, self.kv_dtype, self.device)
        self.page_size = page
        self.max_rows = config.max_running_requests
        # Whole pages per row, plus one column so a sampled token always has a place.
        width = -(-self.context_len // page) * page + 1
        self.page_table = torch.zeros(self.max_rows, width, dtype=torch.int64, device=self.device)
        self.token_pool = torch.zeros(self.max_rows, width, dtype=torch.int64, device=self.device)
        self.backend = TorchBackend(self.pool, self.page_table, cfg.head_dim**-0.5)
        self.sampler = Sampler(config.seed)
        logger.info("KV cache: %d pages of %d tokens (%d tokens, %.2f GiB)%s", self.num_pages,
                    page, self.num_pages * page,
                    self.num_pages * page * cfg.kv_bytes_per_token(self.kv_dtype) / 2**30,
                    "; float32 kernels for half-precision values" if config.fp32_kernels
                    else "")

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
        per_page = self.model_config.kv_bytes_per_token(self.kv_dtype) * self.config.page_size
        return max(1, int(self.config.kv_cache_gb * 2**30) // per_page)

    @torch.inference_mode()
    def forward(self, batch: Batch) -> ForwardOutput:
        """Compute the batch's new tokens, sample one token per request, write it back."""
        lens = batch.extend_lens
        rows = torch.tensor(batch.rows, dtype=torch.int64)
        row_index = rows.repeat_interleave(torch.tensor(lens)).to(self.device)
        positions = torch.cat([torch.arange(s, e) for s, e in zip(batch.starts, batch.ends)])
        positions = positions.to(self.device)
        input_ids = self.token_pool[row_index, positions]
        attn = AttentionContext(self.backend, self.backend.prepare(batch, row_index, positions))
        hidden = self.model(input_ids, positions, attn)
        last = torch.tensor(lens).cumsum(0).sub_(1).to(self.device)
        logits = self.model.compute_logits(hidden[last])
        next_tokens = self.sampler.sample(logits, batch.params, batch.steps)
        keep = torch.tensor(batch.sample, device=self.device)
        ends = torch.tensor(batch.ends, device=self.device)
        self.token_pool[rows.to(self.device)[keep], ends[keep]] = next_tokens[keep]
        return ForwardOutput(next_tokens.cpu(), logits)
