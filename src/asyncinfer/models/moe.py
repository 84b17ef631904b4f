"""The mixture-of-experts block (router, top-k, fused experts) and the family base that puts
it on its layers and loads per-expert checkpoint tensors into the fused weights. See
docs/architecture.md, 'Mixture of experts'."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from asyncinfer.config import ModelConfig
from asyncinfer.distributed.parallel import TensorParallel
from asyncinfer.layers.fused import LayerOps
from asyncinfer.layers.fused_moe import Experts
from asyncinfer.layers.linear import Linear
from asyncinfer.models.blocks import DecoderModel, GatedMLP
from asyncinfer.models.weights import Part


class MoEBlock(nn.Module):
    """``sum_k p_k expert_k(x)`` over the router's top k. ``renormalise``: the top-k
    probabilities divided by their sum; ``weights_in_model_dtype``: rounded to x's dtype
    before they multiply (Qwen3-MoE) rather than in float32 (Mixtral)."""

    def __init__(self, cfg: ModelConfig, intermediate: int, tp: TensorParallel,
                 renormalise: bool, weights_in_model_dtype: bool) -> None:
        super().__init__()
        self.tp, self.top_k, self.intermediate = tp, cfg.experts_per_token, intermediate
        self.renormalise, self.weights_in_model_dtype = renormalise, weights_in_model_dtype
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, intermediate)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and weights [T, k]: softmax in float32, top k."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        return ids, weights

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        ids, weights = self.route(x)
        return self.tp.all_reduce(self.experts(x, ids, weights, ops.act))


# Our names of an expert's three tensors.
PARTS = ("gate", "up", "down")


class MoEModel(DecoderModel):
    """A family whose sparse layers are ``MoEBlock``s; it names its checkpoint's expert
    tensors by ``EXPERT_TENSOR`` (groups: layer, expert, the family's part name)."""

    implements_experts = True
    MOE_MODULE: ClassVar[str] = "mlp"            # the checkpoint's name of the block
    PART_NAMES: ClassVar[dict[str, str]] = {"gate_proj": "gate", "up_proj": "up",
                                            "down_proj": "down"}

    @classmethod
    def refusals(cls, cfg: ModelConfig, context_len: int) -> list[str]:
        found = super().refusals(cfg, context_len)
        if cfg.num_experts and not 1 <= cfg.experts_per_token <= cfg.num_experts:
            found.append(f"num_experts_per_tok={cfg.experts_per_token} (of "
                         f"{cfg.num_experts} experts)")
        return found

    def is_sparse(self, cfg: ModelConfig, layer: int) -> bool:
        """Whether layer ``layer`` is a mixture of experts (else a dense MLP)."""
        return bool(cfg.num_experts) and layer not in cfg.mlp_only_layers and (
            (layer + 1) % cfg.decoder_sparse_step == 0)

    def expert_width(self, cfg: ModelConfig) -> int:
        """An expert's intermediate width on this rank."""
        return cfg.moe_intermediate_size or cfg.intermediate_size

    def moe_block(self, cfg: ModelConfig) -> MoEBlock:
        """The family's block (its routing normalisation)."""
        raise NotImplementedError

    def build_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        if self.is_sparse(cfg, layer):
            return self.moe_block(cfg)
        return GatedMLP(cfg, self.tp)

    def _expert(self, name: str) -> tuple[int, int, str] | None:
        """(layer, expert, our part) of a checkpoint expert tensor's name, else None."""
        found = re.fullmatch(rf"layers\.(\d+)\.{self.MOE_MODULE}\.experts\.(\d+)\.(\w+)"
                             r"\.weight", name)
        if found is None or found[3] not in self.PART_NAMES:
            return None
        return int(found[1]), int(found[2]), self.PART_NAMES[found[3]]

    def _renamed(self, name: str) -> str:
        name = name.removeprefix("model.")
        return name.replace(f".{self.MOE_MODULE}.", ".mlp.", 1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loaded: set[tuple[int, int, str]] = set()

        def rest() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                expert = self._expert(name.removeprefix("model."))
                if expert is None:
                    yield self._renamed(name), tensor
                    continue
                layer, e, part = expert
                block = self.layers[layer].mlp
                if not isinstance(block, MoEBlock):
                    raise KeyError(f"checkpoint tensor {name!r} has no place in the model "
                                   f"(layer {layer} is dense)")
                block.experts.load(e, part, tensor)
                loaded.add(expert)

        super().load_weights(rest())
        want = {(i, e, part) for i, layer in enumerate(self.layers)
                if isinstance(layer.mlp, MoEBlock)
                for e in range(layer.mlp.experts.num_experts) for part in PARTS}
        if want - loaded:
            raise KeyError(f"checkpoint lacks {len(want - loaded)} expert tensors, e.g. "
                           f"{sorted(want - loaded)[:3]} (layer, expert, part)")

    def _fused_loaded(self, name: str, loaded: set[str]) -> bool:
        # The fused experts fill from many tensors: load_weights checks them itself.
        if isinstance(self.get_submodule(name.rpartition(".")[0]), Experts):
            return True
        return super()._fused_loaded(name, loaded)

    def rank_part(self, name: str, shape: tuple[int, ...]) -> Part:
        """An expert's gate/up by rows, its down by columns; the router whole."""
        expert = self._expert(name.removeprefix("model."))
        if expert is None:
            return super().rank_part(self._renamed(name), shape)
        tp = self.tp
        if tp.size == 1:
            return None
        dim = 1 if expert[2] == "down" else 0
        per = shape[dim] // tp.size
        return (dim, tp.rank * per, (tp.rank + 1) * per)
