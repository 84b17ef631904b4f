"""Qwen3-MoE: Qwen3's attention; experts on every ``decoder_sparse_step``-th layer not in
``mlp_only_layers`` (a dense MLP of ``intermediate_size`` there)."""

from __future__ import annotations

from asyncinfer.config import ModelConfig
from asyncinfer.models.blocks import LayerSpec
from asyncinfer.models.moe import MoEBlock, MoEModel


class Qwen3MoeForCausalLM(MoEModel):
    """Qwen3-MoE: routing weights renormalised when ``norm_topk_prob``, rounded to the model's
    dtype before they multiply; experts of ``moe_intermediate_size``."""

    @classmethod
    def layer_spec(cls, cfg: ModelConfig) -> LayerSpec:
        return LayerSpec(qk_norm=True, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias)

    def moe_block(self, cfg: ModelConfig) -> MoEBlock:
        return MoEBlock(cfg, self.expert_width(cfg), self.tp, renormalise=cfg.norm_topk_prob,
                        weights_in_model_dtype=True)
