"""Linear layers, including ones that load several checkpoint tensors into one fused weight.

On a CPU without native bf16/fp16 matrix units, a half-precision GEMM is emulated and several
times slower than float32. There ``use_fp32_shadow`` keeps a float32 copy of the weight and
multiplies in float32: half-precision inputs and weights, float32 accumulation, output
rounded back — the arithmetic of a native bf16 GEMM, at float32 speed.

On a CPU with those units ``pack_for_cpu`` keeps a packed copy of the weight too. Where the
CPU has AMX tile units and our kernels build (``kernels.cpu``), the copy is in the tiles'
own layout for our kernel, which streams the weights at decode sizes faster than oneDNN's
kernels do for these shapes (about 1.6x at one row, 1.2x at forty). An AVX-512 CPU without
AMX gets the same layout, for a kernel that widens the bf16 weights to float32 in registers
and multiplies by float32 FMAs: on such CPUs bf16 dot products can issue at a fraction of
the FMAs' rate (docs/benchmarks.md), and torch's bf16 products are then slower than that at
every size, so the copy takes every product. Otherwise the copy is in oneDNN's blocked
layout: torch's own bf16 GEMM goes through oneDNN, but reorders the weight on every call,
which at decode sizes (tens of rows) costs as much as the product; packed once, a decode
step's products take about half the time, with the same results. Prefill-sized products
(thousands of rows) are about a tenth faster through torch's path, which blocks for their
size: ``PACKED_ROWS`` is where the forward switches. Both copies are kept where memory
allows; otherwise the packed weight replaces the plain one and takes every product.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from attrs import define
from torch import nn
from torch.nn import functional as F

if TYPE_CHECKING:
    from asyncinfer.kernels.cpu import NativeKernels
    from asyncinfer.memory import Slab

PACKED_ROWS = 512
"""Products of at most this many rows use the packed weight (see the module docstring)."""


class Linear(nn.Module):
    """y = x Wᵀ + b, optionally through a float32 shadow of W (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.shadow: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.packed: PackedWeight | None = None
        self.packed_rows: int | None = None  # above this many rows, the plain weight

    def use_fp32_shadow(self) -> None:
        """Multiply in float32 from now on (call after the weights are final)."""
        bias = None if self.bias is None else self.bias.detach().float()
        self.shadow = (self.weight.detach().float(), bias)

    def pack_for_cpu(self, rows_hint: int, keep_plain: bool = True,
                     kernels: NativeKernels | None = None, slab: Slab | None = None) -> None:
        """Multiply through a packed copy of the weight from now on (a CPU with native
        half-precision units; call after the weights are final): for ``kernels``' product
        where it takes the weight, else oneDNN's. ``rows_hint``: the row count oneDNN picks
        its blocking for (any count still works). Without ``keep_plain`` the plain weight's
        memory is given back and the packed copy takes products of any size (as the AVX-512
        kernel's always does: it is the faster at every size). ``slab``: where our kernels'
        copy goes (``pack_weight``)."""
        self.packed = pack_weight(self.weight, rows_hint, kernels, slab)
        self.packed_rows = None if self.packed.takes_all_rows else PACKED_ROWS
        if not keep_plain:
            self.packed_rows = None
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and (self.packed_rows is None
                                        or x.shape[0] <= self.packed_rows):
            return self.packed(x, self.bias)
        if self.shadow is not None:
            return F.linear(x.float(), *self.shadow).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """One matmul for several projections of the same input; ``load(i, w)`` fills part i.

    The output stays fused, [..., sum(sizes)]: the caller splits it where it uses it.
    """

    def __init__(self, in_features: int, out_features: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(out_features), bias)
        self.sizes = list(out_features)
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]

    def load(self, part: int, weight: torch.Tensor, is_bias: bool = False) -> None:
        """Copy a checkpoint tensor into rows of the fused parameter."""
        target = self.bias if is_bias else self.weight
        assert target is not None
        start, size = self.offsets[part], self.sizes[part]
        assert weight.shape[0] == size, f"part {part}: {tuple(weight.shape)} vs {size} rows"
        with torch.no_grad():
            target[start : start + size].copy_(weight)


def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies ``dtype`` natively on this CPU, so packing pays."""
    mkldnn = torch.ops.mkldnn
    if dtype == torch.bfloat16:
        return bool(torch.backends.mkldnn.is_available() and mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.backends.mkldnn.is_available() and mkldnn._is_mkldnn_fp16_supported())
    return False


@define
class PackedWeight:
    """A weight [out, in] packed once for this CPU's matrix units: in the AMX tile layout for
    ``kernels``' product, or (``kernels`` None) in oneDNN's blocked layout."""

    data: torch.Tensor
    out_features: int
    kernels: NativeKernels | None = None

    @property
    def takes_all_rows(self) -> bool:
        """Whether products of every size should come here: our AVX-512 kernel's, which
        beats torch's bf16 products (that CPU's bf16 dot products are slow) at any size."""
        return self.kernels is not None and self.kernels.products == "avx512"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x Wᵀ + b``."""
        if self.kernels is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")
        if x.dim() == 2 and x.stride(1) == 1:  # the model's products: no reshaping
            return self.kernels.linear(x, self.data, self.out_features, bias)
        flat = x.reshape(-1, x.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        out = self.kernels.linear(flat, self.data, self.out_features, bias)
        return out.view(*x.shape[:-1], self.out_features)


def pack_weight(weight: torch.Tensor, rows_hint: int, kernels: NativeKernels | None = None,
                slab: Slab | None = None) -> PackedWeight:
    """``weight`` [out, in] packed once (see the module docstring): for ``kernels``' product
    where it takes the weight (into the next slice of ``slab`` where given), else in
    oneDNN's layout for ``rows_hint`` rows."""
    if kernels is not None and kernels.packs(weight):
        out = None if slab is None else slab.take(weight.numel(), torch.bfloat16)
        return PackedWeight(kernels.pack(weight, out), weight.shape[0], kernels)
    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint),
                        weight.shape[0])


def keeps_both_copies(weight_bytes: int, share: float = 0.125) -> bool:
    """Whether a packed copy of ``weight_bytes`` of weights can sit beside the plain ones:
    when it takes at most ``share`` of the machine's memory (unknown: no). The total, not
    what is free now, so that every run and every tensor-parallel rank on a machine
    decides alike and computes alike."""
    try:
        with open("/proc/meminfo") as f:
            line = next(line for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        return False
    return weight_bytes <= share * int(line.split()[1]) * 1024
