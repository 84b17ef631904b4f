"""Weights from safetensors shards of a local directory, or random ones of the real shapes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from asyncinfer.errors import ModelNotFoundError


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every ``*.safetensors`` shard in the directory."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(
            f"{model_dir} has no *.safetensors files (other weight formats are not supported)")
    for file in files:
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, shard.get_tensor(name)


def init_dummy(model: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarks: small normal values, norms at one."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * 0.02
                param.copy_(values)
