"""Phi-3: Llama's layers with q, k, v in one checkpoint tensor and gate, up in another, and
a sliding window where config.json sets one."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch

from asyncinfer.models.blocks import DecoderModel
from asyncinfer.models.weights import Part

# fused checkpoint projection -> the parts it holds, in row order
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class Phi3ForCausalLM(DecoderModel):
    """Phi-3: fused ``qkv_proj`` and ``gate_up_proj`` tensors are split into their parts at
    load (each rank keeps its rows of each part); longrope ("su") is refused by rope type."""

    implements_sliding_window: ClassVar[bool] = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._split(weights))

    def rank_part(self, name: str, shape: tuple[int, ...]) -> Part:
        """A fused tensor is read whole: its parts' rows of this rank are not one range."""
        if _fused(name) is not None:
            return None
        return super().rank_part(name, shape)

    def _split(self, weights: Iterable[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        cfg, tp = self.config, self.tp
        head_dim, ranks = cfg.head_dim, tp.size
        sizes = {"qkv_proj": [cfg.num_heads * head_dim * ranks,
                              cfg.num_kv_heads * head_dim * ranks,
                              cfg.num_kv_heads * head_dim * ranks],
                 "gate_up_proj": [cfg.intermediate_size * ranks] * 2}
        for name, tensor in weights:
            fused = _fused(name)
            if fused is None:
                yield name, tensor
                continue
            prefix, _, kind = name.rpartition(f".{fused}.")
            for part, piece in zip(_FUSED[fused], tensor.split(sizes[fused])):
                per = piece.shape[0] // ranks
                yield f"{prefix}.{part}.{kind}", piece[tp.rank * per:(tp.rank + 1) * per]


def _fused(name: str) -> str | None:
    """The fused projection ``name`` is a tensor of, or None."""
    return next((f for f in _FUSED if f".{f}." in name), None)
