"""Model families by the architecture name in config.json."""

from __future__ import annotations

from collections.abc import Mapping

from asyncinfer.config import ModelConfig
from asyncinfer.distributed.parallel import TensorParallel
from asyncinfer.errors import UnsupportedModelError
from asyncinfer.layers.rotary import RotaryEmbedding
from asyncinfer.models.base import CausalLM
from asyncinfer.models.blocks import DecoderModel
from asyncinfer.models.gemma3 import Gemma3ForCausalLM
from asyncinfer.models.llama import LlamaForCausalLM
from asyncinfer.models.mistral import MistralForCausalLM
from asyncinfer.models.mixtral import MixtralForCausalLM
from asyncinfer.models.phi3 import Phi3ForCausalLM
from asyncinfer.models.qwen2 import Qwen2ForCausalLM
from asyncinfer.models.qwen3 import Qwen3ForCausalLM
from asyncinfer.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: Mapping[str, type[DecoderModel]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def model_class(architecture: str) -> type[DecoderModel]:
    """The family registered under ``architecture``; UnsupportedModelError for none."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"architecture {architecture} is not supported; "
            f"supported: {', '.join(sorted(MODEL_REGISTRY))}") from None


def check_model(cfg: ModelConfig, context_len: int) -> None:
    """Refuse, naming the field and its value, a model this engine would compute wrongly."""
    found = model_class(cfg.architecture).refusals(cfg, context_len)
    if found:
        raise UnsupportedModelError(
            f"{cfg.architecture}: config.json sets what is not implemented: {'; '.join(found)}")


def build_model(cfg: ModelConfig, rotary: RotaryEmbedding,
                tp: TensorParallel | None = None) -> CausalLM:
    """An uninitialised model of the architecture ``cfg`` names (``cfg``: this rank's shape
    under ``tp``)."""
    return model_class(cfg.architecture)(cfg, rotary, tp)
