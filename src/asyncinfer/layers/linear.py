"""Linear layers: plain, fused (several checkpoint tensors in one weight), and a tied head,
each optionally through a float32 shadow or a packed copy. See docs/architecture.md, 'CPU
matrix products'."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from attrs import define
from torch import nn
from torch.nn import functional as F

if TYPE_CHECKING:
    from asyncinfer.kernels.cpu import NativeKernels
    from asyncinfer.memory import Slab

PACKED_ROWS = 512
"""Products of at most this many rows use the packed weight (larger: torch's own path)."""

Product = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""``(x, W, b) -> x Wᵀ + b``: a matrix product that replaces torch's (``Linear.product``)."""


class Linear(nn.Module):
    """y = x Wᵀ + b, optionally through a float32 shadow or a packed copy of W."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.shadow: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.packed: PackedWeight | None = None
        self.packed_rows: int | None = None  # above this many rows, the plain weight
        self.product: Product | None = None  # every product through it (batch-invariant)

    def use_fp32_shadow(self) -> None:
        """Multiply in float32 from now on, through a float32 copy that replaces W (call
        after the weights are final): two copies would cost a third more memory."""
        bias = None if self.bias is None else self.bias.detach().float()
        self.shadow = (self.weight.detach().float(), bias)
        if self.weight.dtype != torch.float32:
            self.weight.data = self.weight.data.new_empty(0)

    def pack_for_cpu(self, rows_hint: int, keep_plain: bool = True,
                     kernels: NativeKernels | None = None, slab: Slab | None = None,
                     every_size: bool = False) -> None:
        """Multiply through a packed copy from now on (without ``keep_plain``: it alone;
        with ``every_size``: at every number of rows)."""
        self.packed = pack_weight(self.weight, rows_hint, kernels, slab, every_size)
        self.packed_rows = None if self.packed.takes_all_rows else PACKED_ROWS
        if not keep_plain:
            self.packed_rows = None
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.product is not None:
            return self.product(x, self.weight, self.bias)
        if self.packed is not None and (self.packed_rows is None
                                        or x.shape[0] <= self.packed_rows):
            return self.packed(x, self.bias)
        if self.shadow is not None:
            return F.linear(x.float(), *self.shadow).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """One matmul for several projections; ``load(i, w)`` fills part i; the output stays fused."""

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


class TiedHead(nn.Module):
    """The LM head of a model whose embedding is its head (a shadow or packed copy of its own)."""

    embedding: nn.Embedding

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        object.__setattr__(self, "embedding", embedding)  # a reference, not a submodule
        self.shadow: torch.Tensor | None = None
        self.packed: PackedWeight | None = None
        self.product: Product | None = None

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.weight

    def use_fp32_shadow(self) -> None:
        """Multiply in float32 from now on (call after the weights are final)."""
        self.shadow = self.weight.detach().float()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.product is not None:
            return self.product(hidden, self.weight, None)
        if self.packed is not None and (hidden.shape[0] <= PACKED_ROWS
                                        or self.packed.takes_all_rows):
            return self.packed(hidden)
        if self.shadow is not None:  # rounded as a native half-precision GEMM rounds
            return F.linear(hidden.float(), self.shadow).to(hidden.dtype)
        return F.linear(hidden, self.weight)


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
    """A weight [out, in] packed once: for ``kernels``' product, or (None) oneDNN's layout."""

    data: torch.Tensor
    out_features: int
    kernels: NativeKernels | None = None
    every_size: bool = False   # every size here: batch-invariant, or AVX2's float32 products

    @property
    def takes_all_rows(self) -> bool:
        """Whether products of every size come here (our AVX-512 kernel's: faster at any size;
        any of our kernels' with ``every_size``)."""
        return self.kernels is not None and (self.every_size or self.kernels.products == "avx512")

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
                slab: Slab | None = None, every_size: bool = False) -> PackedWeight:
    """``weight`` packed for ``kernels`` where they take it (into ``slab``), else for oneDNN.
    ``every_size``: products of any number of rows go through ``kernels`` (which must take
    it)."""
    if kernels is not None and kernels.packs(weight):
        out = None if slab is None else slab.take(weight.numel(), torch.bfloat16)
        return PackedWeight(kernels.pack(weight, out), weight.shape[0], kernels, every_size)
    assert not every_size, f"our kernels do not take a weight of {tuple(weight.shape)}"
    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint),
                        weight.shape[0])


def keeps_both_copies(weight_bytes: int, share: float = 0.125) -> bool:
    """Whether a packed copy fits beside the plain weights (``share`` of total memory)."""
    try:
        with open("/proc/meminfo") as f:
            line = next(line for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        return False
    return weight_bytes <= share * int(line.split()[1]) * 1024
