"""Mixtral: Mistral's attention (no q/k norm, no bias); every layer a mixture of experts of
``intermediate_size``, checkpoint names ``block_sparse_moe.experts.N.w1/w3/w2``."""

from __future__ import annotations

from asyncinfer.config import ModelConfig
from asyncinfer.models.moe import MoEBlock, MoEModel


class MixtralForCausalLM(MoEModel):
    """Mixtral: the top-k probabilities always renormalised, multiplied in float32."""

    MOE_MODULE = "block_sparse_moe"
    PART_NAMES = {"w1": "gate", "w3": "up", "w2": "down"}  # noqa: RUF012

    def is_sparse(self, cfg: ModelConfig, layer: int) -> bool:
        return True

    def expert_width(self, cfg: ModelConfig) -> int:
        return cfg.intermediate_size

    def moe_block(self, cfg: ModelConfig) -> MoEBlock:
        return MoEBlock(cfg, self.expert_width(cfg), self.tp, renormalise=True,
                        weights_in_model_dtype=False)
