"""Passes over a model's Linear modules: float32 shadows, packed copies for this CPU, or
another product for every one of them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from asyncinfer.errors import ConfigError
from asyncinfer.layers.fused_moe import Experts
from asyncinfer.layers.linear import Linear, Product, TiedHead, keeps_both_copies, pack_weight
from asyncinfer.memory import Slab

if TYPE_CHECKING:
    from asyncinfer.kernels.cpu import NativeKernels


def use_fp32_products(model: nn.Module, kernels: NativeKernels | None) -> None:
    """Run every matrix product of ``model`` in float32: on an AVX2 CPU through our kernel
    (bf16 weights packed once, widened in registers, float32 FMAs, one rounding: a float32
    shadow's arithmetic, without its copy in float32 or torch's per-call packing of it),
    where it takes the weight; over a float32 shadow elsewhere, and for experts."""
    ours = kernels if kernels is not None and kernels.fixed_products == "avx2" else None
    modules = [m for m in model.modules() if isinstance(m, Linear | TiedHead | Experts)]
    packed = [m for m in modules if not isinstance(m, Experts)
              and ours is not None and ours.packs(m.weight)]
    slab = Slab([(m.weight.numel(), torch.bfloat16) for m in packed]) if packed else None
    ids = {id(m) for m in packed}
    for module in modules:
        if id(module) not in ids:
            module.use_fp32_shadow()
        elif isinstance(module, Linear):
            module.pack_for_cpu(0, keep_plain=False, kernels=ours, slab=slab, every_size=True)
        elif isinstance(module, TiedHead):  # the embedding keeps the plain weight
            module.packed = pack_weight(module.weight, 0, ours, slab, every_size=True)


def use_product(model: nn.Module, product: Product) -> None:
    """Run every matrix product of ``model`` through ``product`` (experts: refused by the
    caller, which knows why)."""
    for module in model.modules():
        if isinstance(module, Linear | TiedHead):
            module.product = product


def weight_bytes(model: nn.Module) -> int:
    """The bytes of ``model``'s parameters and float32 shadows (packed copies counted only
    where they replace the plain weight)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, Linear) and module.packed is not None \
                and module.weight.numel() == 0:
            total += module.packed.data.nbytes
        shadow = getattr(module, "shadow", None)
        if isinstance(module, Linear) and shadow is not None:
            total += sum(t.nbytes for t in shadow if t is not None)
        elif isinstance(module, TiedHead) and shadow is not None:
            total += shadow.nbytes
        elif isinstance(module, Experts) and shadow is not None:
            total += sum(t.nbytes for t in shadow)
    return total


def pack_for_cpu(model: nn.Module, rows_hint: int, kernels: NativeKernels | None = None,
                 every_size: bool = False) -> None:
    """Run ``model``'s matrix products through packed weights (``kernels``' where it takes
    them, else oneDNN's): beside the plain ones where memory allows, else instead of them.
    A tied head gets its own packed copy; the embedding stays. ``every_size``: every
    product, of any number of rows, through ``kernels`` (batch-invariant)."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    heads = [m for m in model.modules() if isinstance(m, TiedHead)]
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    expert_weights = [w for m in experts for w in m.weights()]
    keep = keeps_both_copies(sum(m.weight.nbytes for m in linears)
                             + sum(w.nbytes for w in expert_weights))
    # Our kernels' copies side by side in huge pages: a decode step streams them all.
    weights = [m.weight for m in linears] + [h.weight for h in heads] + expert_weights
    if every_size:
        assert not experts, "the batch-invariant mode refuses experts before loading"
        odd = sorted({tuple(w.shape) for w in weights
                      if kernels is None or not kernels.packs(w)})
        if odd:
            raise ConfigError(f"batch_invariant needs every weight in our kernels' layout; "
                              f"these shapes are not (rows a multiple of 16, columns of "
                              f"32): {odd}")
    sizes = [(w.numel(), torch.bfloat16) for w in weights
             if kernels is not None and kernels.packs(w)]
    slab = Slab(sizes) if sizes else None
    for module in linears:
        module.pack_for_cpu(rows_hint, keep_plain=keep, kernels=kernels, slab=slab,
                            every_size=every_size)
    for head in heads:
        head.packed = pack_weight(head.weight, rows_hint, kernels, slab, every_size)
    for block in experts:
        block.pack_for_cpu(rows_hint, keep_plain=keep, kernels=kernels, slab=slab)


def packs_every_weight(model: nn.Module, kernels: NativeKernels | None) -> bool:
    """Whether ``kernels`` take every matrix product of ``model`` (no experts, every weight
    of a shape they pack): what the batch-invariant mode needs."""
    if kernels is None or any(isinstance(m, Experts) for m in model.modules()):
        return False
    weights = [m.weight for m in model.modules() if isinstance(m, (Linear, TiedHead))]
    return all(kernels.packs(w) for w in weights)
