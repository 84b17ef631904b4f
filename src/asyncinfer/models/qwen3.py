"""Qwen3: Llama plus an RMSNorm over each head of q and k before the rotation."""

from __future__ import annotations

from asyncinfer.config import ModelConfig
from asyncinfer.models.blocks import DecoderModel, LayerSpec


class Qwen3ForCausalLM(DecoderModel):
    """Qwen3 (dense): q/k norms; ``attention_bias`` as Llama's."""

    @classmethod
    def layer_spec(cls, cfg: ModelConfig) -> LayerSpec:
        return LayerSpec(qk_norm=True, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias)
