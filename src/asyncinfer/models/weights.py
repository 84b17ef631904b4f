"""Weights from safetensors shards of a local directory, or random ones of the real shapes."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from asyncinfer.errors import ModelNotFoundError
from asyncinfer.models.source import Progress

# Part of a tensor to read: None, all; (dim, start, stop); ZEROS, zeros of the full shape.
Part = tuple[int, int, int] | None
ZEROS = (-1, 0, 0)


def iter_safetensors(model_dir: Path,
                     part: Callable[[str, tuple[int, ...]], Part] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the directory's ``*.safetensors`` shards (with ``part``: only that part)."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(
            f"{model_dir} has no *.safetensors files (other weight formats are not supported)")
    # Lines, not a bar: tensor-parallel ranks load at the same time, each in its process.
    progress = Progress(f"loading weights from {model_dir}",
                        sum(f.stat().st_size for f in files), bar=False)
    for file in files:
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                lazy = shard.get_slice(name)
                shape = tuple(lazy.get_shape())
                wanted = None if part is None else part(name, shape)
                if wanted is None:
                    yield name, shard.get_tensor(name)
                elif wanted == ZEROS:
                    yield name, torch.zeros(shape, dtype=_dtype(lazy.get_dtype()))
                else:
                    dim, start, stop = wanted
                    index = tuple([slice(None)] * dim + [slice(start, stop)])
                    yield name, lazy[index]
                progress.update(math.prod(shape) * _ITEM_BYTES.get(lazy.get_dtype(), 2))
    progress.close("loaded")


def init_dummy(model: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarks: small normal values, norms at one, drawn on the
    parameters' own device in their own dtype (a 30B model never passes through the host)."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
                continue
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            param.normal_(0.0, 0.02, generator=gen)


_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1,
               "BOOL": 1}


def _dtype(name: str) -> torch.dtype:
    """A safetensors dtype name ("F32", "BF16", ...) as a torch dtype."""
    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
            "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
            "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}[name]
