"""Gemma 3 (text): (1 + w) RMSNorms around both sublayers, q/k norms, GeGLU (tanh), scaled
embeddings, query_pre_attn_scalar, and local (sliding) layers interleaved with global ones,
each kind with its own rope base. See docs/architecture.md, 'Gemma 3'."""

from __future__ import annotations

import functools
from typing import ClassVar

import torch

from asyncinfer.attention.base import AttentionContext
from asyncinfer.config import ModelConfig
from asyncinfer.distributed.parallel import TensorParallel
from asyncinfer.layers.fused import LayerOps, OpNames
from asyncinfer.layers.norm import OffsetRMSNorm
from asyncinfer.layers.rotary import ROPE_TYPES, RotaryEmbedding, layer_rope_types
from asyncinfer.models.blocks import DecoderLayer, DecoderModel, LayerSpec

LAYER_TYPES = ("sliding_attention", "full_attention")


class Gemma3DecoderLayer(DecoderLayer):
    """Norms before and after attention and MLP, the residual added after the post-norms.
    Invariant (as DecoderLayer): returns (post-feedforward-normed MLP output, stream before
    its add)."""

    norm_class = OffsetRMSNorm

    def __init__(self, cfg: ModelConfig, layer: int, spec: LayerSpec,
                 tp: TensorParallel, mlp: torch.nn.Module | None = None,
                 sliding_window: int | None = None) -> None:
        super().__init__(cfg, layer, spec, tp, mlp, sliding_window)
        self.pre_feedforward_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)

    def feed_forward(self, h: torch.Tensor, residual: torch.Tensor,
                     ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        norm = self.post_attention_layernorm
        h = ops.norm(h, norm.weight, norm.eps)
        norm = self.pre_feedforward_layernorm
        h, residual = ops.add_norm(h, residual, norm.weight, norm.eps)
        h = self.mlp(h, ops)
        norm = self.post_feedforward_layernorm
        return ops.norm(h, norm.weight, norm.eps), residual


class Gemma3ForCausalLM(DecoderModel):
    """Gemma 3's text decoder; ``layer_types`` says which layers slide (``windows``)."""

    layer_class = Gemma3DecoderLayer
    implements_sliding_window: ClassVar[bool] = True

    @classmethod
    def layer_spec(cls, cfg: ModelConfig) -> LayerSpec:
        return LayerSpec(qk_norm=True, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias)

    @classmethod
    def refusals(cls, cfg: ModelConfig, context_len: int) -> list[str]:
        # Rope parameters per layer type are what Gemma 3 computes; each type's is checked.
        found = [f for f in super().refusals(cfg, context_len)
                 if not f.startswith("rope_type='per-layer'")]
        hf = cfg.hf_config
        for layer_type, rope_type in layer_rope_types(hf).items():
            if rope_type not in ROPE_TYPES:
                found.append(f"rope_parameters[{layer_type!r}].rope_type={rope_type!r} "
                             f"(implemented: {', '.join(ROPE_TYPES)})")
        unknown = sorted(set(_layer_types(cfg)) - set(LAYER_TYPES))
        if unknown:
            found.append(f"layer_types={unknown} (implemented: {', '.join(LAYER_TYPES)})")
        unroped = sorted(set(_layer_types(cfg)) - set(layer_rope_types(hf)))
        if unroped:
            found.append(f"rope_parameters without {unroped} (one set per layer type)")
        if getattr(hf, "use_bidirectional_attention", False):
            found.append("use_bidirectional_attention=True")
        return found

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding,
                 tp: TensorParallel | None = None) -> None:
        super().__init__(cfg, rotary, tp)
        self.layer_types = _layer_types(cfg)
        self.op_names = OpNames(activation=cfg.hidden_act, norm="offset_rms")
        self.ops = LayerOps(self.op_names)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionContext) -> torch.Tensor:
        x = self._embed(input_ids)
        tables = {t: r.lookup(positions, x.dtype) for t, r in self.rotary.by_layer_type.items()}
        residual: torch.Tensor | None = None
        for layer, layer_type in zip(self.layers, self.layer_types):
            x, residual = layer(x, residual, tables[layer_type], attn, self.ops)
        assert residual is not None
        return self.ops.add_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super()._embed(input_ids)
        return x * _embed_scale(self.config.hidden_size, x.dtype)


@functools.cache
def _embed_scale(hidden: int, dtype: torch.dtype) -> float:
    """sqrt(hidden) rounded to float32, then to ``dtype``, as transformers rounds it (a
    host number: nothing is copied to the device, under CUDA-graph capture neither)."""
    return float(torch.tensor(hidden**0.5, dtype=torch.float32).to(dtype))


def _layer_types(cfg: ModelConfig) -> list[str]:
    return list(cfg.hf_config.layer_types)
