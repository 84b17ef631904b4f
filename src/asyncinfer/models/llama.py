"""The Llama family (Llama 2 and 3, SmolLM2)."""

from __future__ import annotations

from asyncinfer.config import ModelConfig
from asyncinfer.models.blocks import DecoderModel, LayerSpec


class LlamaForCausalLM(DecoderModel):
    """Llama: ``attention_bias`` puts a bias on q, k, v and o alike."""

    @classmethod
    def layer_spec(cls, cfg: ModelConfig) -> LayerSpec:
        return LayerSpec(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias)
