"""Model implementations, looked up by the architecture name in config.json."""

from __future__ import annotations

from asyncinfer.config import ModelConfig
from asyncinfer.distributed.parallel import TensorParallel
from asyncinfer.errors import UnsupportedModelError
from asyncinfer.layers.rotary import RotaryEmbedding
from asyncinfer.models.llama import LlamaForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def build_model(cfg: ModelConfig, rotary: RotaryEmbedding,
                tp: TensorParallel | None = None) -> LlamaForCausalLM:
    """An uninitialised model of the architecture ``cfg`` names (``cfg``: this rank's shape
    under ``tp``)."""
    try:
        cls = MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"architecture {cfg.architecture} is not supported; "
            f"supported: {', '.join(sorted(MODEL_REGISTRY))}") from None
    return cls(cfg, rotary, tp)
