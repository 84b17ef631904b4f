"""Whether the engine runs batch-invariant, and where the mode is refused: see
docs/architecture.md, 'Batch-invariant mode'."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from asyncinfer.config import EngineConfig
from asyncinfer.errors import ConfigError
from asyncinfer.kernels import triton_invariant

if TYPE_CHECKING:
    from asyncinfer.kernels.cpu import NativeKernels


def batch_invariant(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                    kernels: NativeKernels | None, experts: int) -> bool:
    """Whether the engine runs batch-invariant: ``config.batch_invariant`` if set (on:
    checked by :func:`check_batch_invariant`); by default, where the mode holds and its cost
    was measured as nothing (docs/benchmarks.md): bf16 on our AVX-512 products, no AMX (its
    prefill products and attention would leave their faster paths), a dense model (weights
    our kernels do not take turn it off later, in ``_load_model``)."""
    if config.batch_invariant is not None:
        if config.batch_invariant:
            check_batch_invariant(config, device, dtype, kernels)
            if experts:
                raise ConfigError("batch_invariant does not run mixture-of-experts models "
                                  "yet (their grouped products follow the batch)")
        return config.batch_invariant
    try:
        check_batch_invariant(config, device, dtype, kernels)
    except ConfigError:
        return False
    return (kernels is not None and kernels.products == "avx512" and not experts
            and not config.fp32_kernels)


def triton_invariant_path(device: torch.device) -> bool:
    """Whether the batch-invariant mode runs through its Triton kernels
    (``kernels.triton_invariant``) on ``device``: on CUDA; the CPU has its own."""
    return device.type == "cuda"


def check_batch_invariant(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                          kernels: NativeKernels | None) -> None:
    """Refuse ``batch_invariant`` where its guarantee would not hold, naming why. On CUDA it
    needs Triton, for its own kernels, and the attention they implement; on a CPU the CPU's
    own product kernels (AVX-512, AMX or AVX2), which multiply every row in one fixed order
    of sums whatever the number of rows, and bf16 weights they take. Past two
    tensor-parallel ranks the all-reduce's order follows the batch, anywhere."""
    if config.kv_cache_torch_dtype is not None:
        raise ConfigError(f"batch_invariant does not run with kv_cache_dtype "
                          f"{config.kv_cache_dtype!r}: its attention kernels read bf16 or "
                          f"float32 caches")
    if config.tensor_parallel_size > 2:
        raise ConfigError("batch_invariant runs on one or two tensor-parallel ranks: with "
                          "more, the all-reduce's order of sums follows the batch's size")
    if triton_invariant_path(device):
        if not triton_invariant.available(device):
            raise ConfigError("batch_invariant on CUDA needs triton (pip install triton): "
                              "its products, norms and attention are Triton kernels")
        if config.attention_backend == "flashinfer":
            raise ConfigError("batch_invariant attends through its own kernel (attention_"
                              "backend torch or auto): flashinfer's split of the keys "
                              "follows the batch")
        return
    if device.type != "cpu":
        raise ConfigError(f"batch_invariant runs on CPUs and CUDA GPUs, not {device.type}")
    if kernels is None or kernels.fixed_products is None:
        raise ConfigError("batch_invariant needs this CPU's own matrix-product kernels "
                          "(AVX-512, AMX, or AVX2 with FMA, and a C compiler; cpu_kernels "
                          "on): elsewhere products go through oneDNN, whose order of sums "
                          "follows the number of rows")
    if dtype != torch.bfloat16:
        raise ConfigError("batch_invariant needs a bfloat16 model (dtype bfloat16): our "
                          "product kernels take bf16 weights")
