"""What the runner, CUDA graphs and the weight loader need of a model (``CausalLM``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
from torch import nn

from asyncinfer.attention.base import AttentionContext
from asyncinfer.config import ModelConfig
from asyncinfer.layers.fused import LayerOps, OpNames, WarmUpArgs
from asyncinfer.models.weights import Part


class CausalLM(Protocol):
    """A decoder-only model over a flat batch (``config``: this rank's shape)."""

    config: ModelConfig
    ops: LayerOps
    op_names: OpNames
    windows: tuple[int | None, ...]   # each layer's sliding window (None: full attention)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attn: AttentionContext) -> torch.Tensor:
        """Final hidden states [T, hidden] of every computed token."""
        ...

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Logits over the whole vocabulary: float32, or the model's dtype (``upcast=False``)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (transformers' names; this rank's parts) into the model."""
        ...

    def rank_part(self, name: str, shape: tuple[int, ...]) -> Part:
        """The part of checkpoint tensor ``name`` of ``shape`` this rank reads."""
        ...

    def warm_up_args(self) -> WarmUpArgs:
        """One layer's sizes and weights, for compiling the layer ops ahead of a request."""
        ...

    def modules(self) -> Iterator[nn.Module]:
        """Every module (the packing and float32 passes walk them)."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """Every weight."""
        ...
