"""Qwen2 (and Qwen2.5): Llama with a bias on q, k and v, none on o."""

from __future__ import annotations

from asyncinfer.config import ModelConfig
from asyncinfer.models.blocks import DecoderModel, LayerSpec


class Qwen2ForCausalLM(DecoderModel):
    """Qwen2: its config has no ``attention_bias``; the bias layout is fixed."""

    @classmethod
    def layer_spec(cls, cfg: ModelConfig) -> LayerSpec:
        return LayerSpec(qkv_bias=True, o_bias=False)
