"""The Llama family (SmolLM2, Llama 3) and Qwen3, written for paged attention.

Qwen3 is Llama plus an RMSNorm over each head of q and k before the rotation. Split over
tensor-parallel ranks (see asyncinfer.distributed.parallel), a model is built from its rank's
shape (``ModelConfig.sharded``): the attention and MLP outputs are summed over the ranks,
the embedding and LM head hold the rank's vocabulary rows, and ``rank_part`` says which part
of each checkpoint tensor this rank reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from asyncinfer.attention.base import AttentionContext
from asyncinfer.config import ModelConfig
from asyncinfer.distributed.parallel import TensorParallel
from asyncinfer.kvcache.pool import KVPool
from asyncinfer.layers.fused import LayerOps
from asyncinfer.layers.linear import (
    PACKED_ROWS,
    Linear,
    MergedLinear,
    PackedWeight,
    keeps_both_copies,
    pack_weight,
)
from asyncinfer.layers.norm import RMSNorm
from asyncinfer.layers.rotary import RotaryEmbedding, RotaryTables
from asyncinfer.memory import Slab
from asyncinfer.models.weights import ZEROS, Part

if TYPE_CHECKING:
    from asyncinfer.kernels.cpu import NativeKernels


class Attention(nn.Module):
    """Self-attention of one layer; the KV cache lives in the backend, not here."""

    def __init__(self, cfg: ModelConfig, layer: int, qk_norm: bool,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.layer, self.tp = layer, tp
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q_size, kv_size, kv_size],
                                     bias=cfg.attention_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, rotary: RotaryTables, attn: AttentionContext,
                ops: LayerOps) -> torch.Tensor:
        q, k, v = ops.qk_norm_rope_store(
            self.qkv_proj(x), rotary.cos, rotary.sin,
            None if self.q_norm is None else self.q_norm.weight,
            None if self.k_norm is None else self.k_norm.weight,
            self.eps, self.heads, self.kv_heads, self.head_dim, *attn.kv_slots(self.layer))
        return self.tp.all_reduce(self.o_proj(attn(self.layer, q, k, v)))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up in one matmul."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(ops.silu_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each with a residual connection.

    The residual stream is carried beside the hidden state so that each residual add is
    fused with the norm that follows it: a layer takes (the previous layer's MLP output,
    the stream before that add) and returns the same pair.
    """

    def __init__(self, cfg: ModelConfig, layer: int, qk_norm: bool,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, qk_norm, tp)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rotary: RotaryTables,
                attn: AttentionContext, ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        norm = self.input_layernorm
        if residual is None:  # the first layer: the embeddings are the stream
            h, residual = ops.rms_norm(x, norm.weight, norm.eps), x
        else:
            h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self.self_attn(h, rotary, attn, ops)
        norm = self.post_attention_layernorm
        h, residual = ops.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(h, ops), residual


# Row-parallel projections: their weights split by columns, their outputs summed.
_ROW_PARALLEL = (".o_proj.", ".down_proj.")

# checkpoint name fragment -> (our fused module, part index)
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """Token ids in a flat batch (all requests' new tokens concatenated) to hidden states.

    ``cfg`` is this rank's shape (``ModelConfig.sharded``) under ``tp``."""

    qk_norm = False

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = rotary
        self.tp = tp or TensorParallel()
        self.vocab_start, rows = self.tp.vocab_rows(cfg.vocab_size)
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.qk_norm, self.tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tied_shadow: torch.Tensor | None = None
        self.tied_packed: PackedWeight | None = None
        self.lm_head = (None if cfg.tie_word_embeddings
                        else Linear(cfg.hidden_size, rows))
        self.ops = LayerOps()

    def compile_layer_ops(self, pool: KVPool, backend: str = "inductor") -> None:
        """Run the work between matrix products through torch.compile (see layers.fused),
        compiling each function now, not on the first request (``pool``: the KV pool, still
        empty)."""
        self.ops = LayerOps(compile=True, backend=backend, device=pool.k.device)
        self.ops.warm_up(self.layers[0], self.rotary, self.embed_tokens.weight, pool.k[0],
                         pool.v[0])

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of every computed token."""
        x = self._embed(input_ids)
        rotary = self.rotary.lookup(positions, x.dtype)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, rotary, attn, self.ops)
        if residual is None:
            return self.ops.rms_norm(x, self.norm.weight, self.norm.eps)
        return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        # Rows other ranks hold contribute zeros here; the sum over ranks has them all.
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        x = self.embed_tokens(torch.where(mine, local, 0)) * mine.unsqueeze(-1)
        return self.tp.all_reduce(x)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Logits over the vocabulary, in float32 (``upcast=False``: in the model's dtype,
        for a sampler that widens them as it reads them); every rank gets all of them."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        elif self.tied_packed is not None and (hidden.shape[0] <= PACKED_ROWS
                                               or self.tied_packed.takes_all_rows):
            logits = self.tied_packed(hidden)
        elif self.tied_shadow is not None:
            # Rounded as a native half-precision GEMM would round it.
            logits = F.linear(hidden.float(), self.tied_shadow).to(hidden.dtype)
        else:
            logits = F.linear(hidden, self.embed_tokens.weight)
        logits = self.tp.gather_vocab(logits, self.config.vocab_size)
        return logits.float() if upcast else logits

    def use_fp32_shadow(self) -> None:
        """Run every matrix product in float32 over a copy of the weights (see layers.linear)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.use_fp32_shadow()
        if self.lm_head is None:
            self.tied_shadow = self.embed_tokens.weight.detach().float()

    def pack_for_cpu(self, rows_hint: int, kernels: NativeKernels | None = None) -> None:
        """Run the matrix products through packed weights (see layers.linear; for
        ``kernels``' product where it takes them, else oneDNN's): beside the plain ones
        where memory allows, else instead of them (the embedding stays: the tied head gets
        its own packed copy)."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        keep = keeps_both_copies(sum(m.weight.nbytes for m in linears))
        # Our kernels' copies side by side in huge pages: a decode step streams them all.
        weights: list[torch.Tensor] = [m.weight for m in linears]
        if self.lm_head is None:
            weights.append(self.embed_tokens.weight)
        sizes = [(w.numel(), torch.bfloat16) for w in weights
                 if kernels is not None and kernels.packs(w)]
        slab = Slab(sizes) if sizes else None
        for module in linears:
            module.pack_for_cpu(rows_hint, keep_plain=keep, kernels=kernels, slab=slab)
        if self.lm_head is None:
            self.tied_packed = pack_weight(self.embed_tokens.weight, rows_hint, kernels, slab)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (transformers' names) into the fused parameters; under
        tensor parallelism, each tensor's part for this rank (``rank_part``)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            for fragment, (fused, part) in _STACKED.items():
                if f".{fragment}." in name:
                    module_name, _, kind = name.replace(fragment, fused).rpartition(".")
                    module = self.get_submodule(module_name)
                    assert isinstance(module, MergedLinear)
                    module.load(part, tensor, is_bias=kind == "bias")
                    loaded.add(f"{module_name}.{kind}#{part}")
                    break
            else:
                if name not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
                with torch.no_grad():
                    params[name].copy_(tensor)
                loaded.add(name)
        missing = [n for n in params if n not in loaded and not self._fused_loaded(n, loaded)]
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def rank_part(self, name: str, shape: tuple[int, ...]) -> Part:
        """The part of checkpoint tensor ``name`` (of ``shape``) this rank holds, for
        ``iter_safetensors``: rows of the column-parallel projections and the vocabulary,
        columns of the row-parallel ones; a row-parallel bias is added after the sum, so
        rank 0 holds it and the others zeros; norms whole."""
        tp = self.tp
        name = name.removeprefix("model.")
        if tp.size == 1:
            return None
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return (0, self.vocab_start, self.vocab_start + self.embed_tokens.num_embeddings)
        if any(row in name for row in _ROW_PARALLEL):
            if name.endswith(".weight"):
                per = shape[1] // tp.size
                return (1, tp.rank * per, (tp.rank + 1) * per)
            return None if tp.rank == 0 else ZEROS
        if any(f".{fragment}." in name for fragment in _STACKED):
            per = shape[0] // tp.size
            return (0, tp.rank * per, (tp.rank + 1) * per)
        return None

    def _fused_loaded(self, name: str, loaded: set[str]) -> bool:
        module = self.get_submodule(name.rpartition(".")[0])
        if not isinstance(module, MergedLinear):
            return False
        return all(f"{name}#{i}" in loaded for i in range(len(module.sizes)))


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with per-head RMSNorm on q and k."""

    qk_norm = True
