"""Machine checks before anything loads: what this host cannot run, refused naming flags."""

from __future__ import annotations

import logging
import math
import os
import warnings
from collections.abc import Mapping
from typing import Any

from asyncinfer.config import EngineConfig
from asyncinfer.errors import ConfigError, ModelNotFoundError
from asyncinfer.options import flag

__all__ = ["check_environment"]

logger = logging.getLogger(__name__)


def check_environment(config: EngineConfig, replicas: int = 1) -> None:
    """Refuse, with one ConfigError naming the flags, what this machine cannot run ``config``
    with (``replicas`` copies, each on GPUs of its own), before anything loads.

    Checked: the model path, a CUDA build of torch that sees enough GPUs, the attention
    backend on this device and dtype, a tensor-parallel split the model's shape divides.
    """
    import torch

    from asyncinfer.attention.registry import backend_class
    from asyncinfer.models.source import peek_config

    try:
        shape = peek_config(config.model)
    except ModelNotFoundError as exc:
        raise ConfigError(f"{flag('model')}: {exc}") from None
    if config.is_cuda:
        _check_gpus(config, replicas)
    backend = config.resolved_attention_backend
    backend_class(backend).check(torch.device(config.device), config.torch_dtype)
    if (config.is_cuda and backend == "torch" and config.attention_backend == "auto"
            and config.torch_dtype != torch.float32):
        logger.warning("flashinfer is not installed: attention on %s runs on the torch "
                       "backend, without CUDA graphs (pip install -e .[cuda] for flashinfer)",
                       config.device)
    if config.tensor_parallel_size > 1 and shape is not None:
        _check_split(config.tensor_parallel_size, shape)


def _check_gpus(config: EngineConfig, replicas: int) -> None:
    """A CUDA build of torch that sees every GPU the ranks of every replica take."""
    import torch

    device, version = config.device, torch.__version__
    if not torch.backends.cuda.is_built():
        raise ConfigError(
            f"{flag('device')} {device}: the installed torch {version} is a CPU-only build; "
            "install a CUDA build of torch (https://pytorch.org/get-started/locally/), then "
            f"`pip install -e .[cuda]` for flashinfer, or use {flag('device')} cpu")
    with warnings.catch_warnings(record=True) as caught:  # a driver problem is a warning
        warnings.simplefilter("always")
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        why = f" ({str(caught[0].message).strip().splitlines()[0]})" if caught else ""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hidden = (f" and CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "")
        raise ConfigError(
            f"{flag('device')} {device}: torch {version} (CUDA {torch.version.cuda}) sees no "
            f"GPU{why}; check the driver with nvidia-smi{hidden}, or use {flag('device')} cpu")
    first = int(device.partition(":")[2] or 0)
    seen = f"{gpus} GPU{'s are' if gpus > 1 else ' is'} visible (cuda:0" + (
        f" to cuda:{gpus - 1})" if gpus > 1 else ")")
    if first >= gpus:
        raise ConfigError(f"{flag('device')} {device}: no such GPU; {seen}")
    ranks = config.tensor_parallel_size
    needed = ranks * replicas
    if first + needed > gpus:
        asked = f"{flag('tensor_parallel_size')} {ranks}" + (
            f" with --dp {replicas}" if replicas > 1 else "")
        raise ConfigError(
            f"{asked} takes {needed} GPUs, cuda:{first} to cuda:{first + needed - 1}, but "
            f"{seen}; lower {flag('tensor_parallel_size')}"
            + (" or --dp" if replicas > 1 else "")
            + (f", or start from a lower {flag('device')}" if first else ""))


def _check_split(ranks: int, shape: Mapping[str, Any]) -> None:
    """The model's heads, KV heads and MLP width divide by the tensor-parallel size."""
    from asyncinfer.distributed.parallel import TensorParallel

    heads, width = shape.get("num_attention_heads"), shape.get("intermediate_size")
    experts_width = shape.get("moe_intermediate_size")
    if isinstance(width, int) and isinstance(experts_width, int):
        width = math.gcd(width, experts_width)  # dense and expert widths alike split
    kv_heads = shape.get("num_key_value_heads") or heads
    if not (isinstance(heads, int) and isinstance(kv_heads, int) and isinstance(width, int)
            and min(heads, kv_heads, width) > 0):
        return  # not a shape this check knows: the engine checks it once it reads it
    try:
        TensorParallel(0, ranks).check(heads, kv_heads, width)
    except ConfigError as exc:
        common = math.gcd(heads, kv_heads, width)
        sizes = [str(n) for n in range(1, common + 1) if common % n == 0]
        raise ConfigError(f"{exc}; it splits over {flag('tensor_parallel_size')} "
                          f"{', '.join(sizes[:-1]) + ' or ' if len(sizes) > 1 else ''}"
                          f"{sizes[-1]}") from None
