"""Rotary position embedding, tabled once: the rope types whose frequencies are fixed."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""Rope types computed here (as transformers does); the others change with the length."""


def layer_rope_types(hf_config: Any) -> dict[str, str]:
    """Layer type -> rope type, for a config whose ``rope_parameters`` holds one set per
    layer type (Gemma 3: ``sliding_attention``, ``full_attention``); else empty."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if not params or not all(isinstance(v, dict) for v in params.values()):
        return {}
    return {t: str(p.get("rope_type", "default")) for t, p in params.items()}


def _inv_freq(hf_config: Any, head_dim: int,
              layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta**exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(scale)


class RotaryEmbedding:
    """cos/sin tabled in float32 up to ``max_positions``; a plain object, not a module (its
    tables are never loaded, cast or emptied). For a config with rope parameters per layer
    type, ``by_layer_type`` holds each type's tables (and this one is the first type's)."""

    def __init__(
        self, hf_config: Any, head_dim: int, max_positions: int, device: torch.device,
        layer_type: str | None = None,
    ) -> None:
        types = list(layer_rope_types(hf_config)) if layer_type is None else []
        self.by_layer_type = {t: RotaryEmbedding(hf_config, head_dim, max_positions, device, t)
                              for t in types}
        inv_freq, scale = _inv_freq(hf_config, head_dim, layer_type or next(iter(types), None))
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scale).to(device)
        self.sin = (emb.sin() * scale).to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryTables:
        """cos and sin of each token's position, once per forward for all layers."""
        return RotaryTables(self.cos[positions].to(dtype).unsqueeze(1),
                            self.sin[positions].to(dtype).unsqueeze(1))


class RotaryTables(NamedTuple):
    """cos and sin, [T, 1, dim], of the tokens of one forward."""

    cos: torch.Tensor
    sin: torch.Tensor
