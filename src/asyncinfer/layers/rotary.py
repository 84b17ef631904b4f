"""Rotary position embedding with every rope type transformers knows (default, llama3, yarn...)."""

from __future__ import annotations

from typing import Any

import torch


def _inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta**exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scale)


class RotaryEmbedding:
    """Rotates q and k by position; cos/sin are tabled in float32 up to ``max_positions``.

    A plain object, not a module: its tables are derived, never loaded, cast or emptied.
    """

    def __init__(
        self, hf_config: Any, head_dim: int, max_positions: int, device: torch.device
    ) -> None:
        inv_freq, scale = _inv_freq(hf_config, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scale).to(device)
        self.sin = (emb.sin() * scale).to(device)

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, dim], k: [T, kv_heads, dim], positions: [T]."""
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
