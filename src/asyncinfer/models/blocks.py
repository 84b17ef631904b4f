"""The blocks decoder-only families share: attention, gated MLP, decoder layer, and the model
around them. A family is a ``DecoderModel`` subclass with its ``LayerSpec``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import ClassVar, cast

import torch
from attrs import frozen
from torch import nn

from asyncinfer.attention.base import AttentionContext
from asyncinfer.config import ModelConfig
from asyncinfer.distributed.parallel import TensorParallel
from asyncinfer.layers.fused import ACTIVATIONS, LayerOps, OpNames, WarmUpArgs
from asyncinfer.layers.linear import Linear, MergedLinear, TiedHead
from asyncinfer.layers.norm import RMSNorm
from asyncinfer.layers.rotary import ROPE_TYPES, RotaryEmbedding, RotaryTables
from asyncinfer.models.weights import ZEROS, Part


@frozen
class LayerSpec:
    """How a family's layers differ from Llama's."""

    qk_norm: bool = False   # RMSNorm over each head of q and k before the rotation (Qwen3)
    qkv_bias: bool = False
    o_bias: bool = False


class Attention(nn.Module):
    """Self-attention of one layer; the KV cache lives in the backend, not here.
    ``sliding_window``: this layer's window (None: full attention), handed to the backend;
    ``norm``: the q/k norms' kind (with ``spec.qk_norm``)."""

    def __init__(self, cfg: ModelConfig, layer: int, spec: LayerSpec,
                 tp: TensorParallel, sliding_window: int | None = None,
                 norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.layer, self.tp, self.sliding_window = layer, tp, sliding_window
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q_size, kv_size, kv_size],
                                     bias=spec.qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=spec.o_bias)
        self.q_norm = norm(self.head_dim, cfg.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = norm(self.head_dim, cfg.rms_norm_eps) if spec.qk_norm else None

    def forward(self, x: torch.Tensor, rotary: RotaryTables, attn: AttentionContext,
                ops: LayerOps) -> torch.Tensor:
        q, k, v = ops.qk_norm_rope_store(
            self.qkv_proj(x), rotary.cos, rotary.sin,
            None if self.q_norm is None else self.q_norm.weight,
            None if self.k_norm is None else self.k_norm.weight,
            self.eps, self.heads, self.kv_heads, self.head_dim, *attn.kv_slots(self.layer))
        out = attn(self.layer, q, k, v, self.sliding_window)
        return self.tp.all_reduce(self.o_proj(out))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up in one matmul."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.intermediate = tp, cfg.intermediate_size
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(ops.act(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residuals. Invariant: a layer takes and returns
    (output, stream before the add), so each add fuses with the next norm. A family whose
    layer differs sets ``norm_class`` (every norm's kind) and overrides ``feed_forward`` (what
    follows attention)."""

    norm_class: ClassVar[type[RMSNorm]] = RMSNorm

    def __init__(self, cfg: ModelConfig, layer: int, spec: LayerSpec,
                 tp: TensorParallel, mlp: nn.Module | None = None,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, spec, tp, sliding_window, self.norm_class)
        self.mlp = mlp if mlp is not None else GatedMLP(cfg, tp)
        self.input_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rotary: RotaryTables,
                attn: AttentionContext, ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        norm = self.input_layernorm
        if residual is None:  # the first layer: the embeddings are the stream
            h, residual = ops.norm(x, norm.weight, norm.eps), x
        else:
            h, residual = ops.add_norm(x, residual, norm.weight, norm.eps)
        return self.feed_forward(self.self_attn(h, rotary, attn, ops), residual, ops)

    def feed_forward(self, h: torch.Tensor, residual: torch.Tensor,
                     ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output ``h`` added to the stream, normed, through the MLP:
        (MLP output, stream before its add)."""
        norm = self.post_attention_layernorm
        h, residual = ops.add_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(h, ops), residual

    def warm_up_args(self) -> WarmUpArgs:
        attn, norm = self.self_attn, self.input_layernorm
        return WarmUpArgs(
            hidden=norm.weight.shape[0], intermediate=cast(int, self.mlp.intermediate),
            heads=attn.heads, kv_heads=attn.kv_heads, head_dim=attn.head_dim,
            qk_eps=attn.eps, norm_weight=norm.weight, norm_eps=norm.eps,
            q_norm_weight=None if attn.q_norm is None else attn.q_norm.weight,
            k_norm_weight=None if attn.k_norm is None else attn.k_norm.weight)


# Row-parallel projections: their weights split by columns, their outputs summed.
_ROW_PARALLEL = (".o_proj.", ".down_proj.")

# checkpoint name fragment -> (our fused module, part index)
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class DecoderModel(nn.Module):
    """A ``CausalLM`` of DecoderLayers; ``cfg`` is this rank's shape under ``tp``."""

    layer_class: ClassVar[type[DecoderLayer]] = DecoderLayer
    implements_experts: ClassVar[bool] = False  # a mixture-of-experts family (models.moe)
    implements_sliding_window: ClassVar[bool] = False
    """Whether the family attends through config.json's ``sliding_window`` (else refused)."""

    @classmethod
    def layer_window(cls, cfg: ModelConfig, layer: int) -> int | None:
        """Layer ``layer``'s attention window (None: full): ``cfg.sliding_window`` on the
        layers ``layer_types`` marks ``sliding_attention``, on all where it has none."""
        types = getattr(cfg.hf_config, "layer_types", None)
        if cfg.sliding_window is None or (types and types[layer] != "sliding_attention"):
            return None
        return cfg.sliding_window

    @classmethod
    def layer_spec(cls, cfg: ModelConfig) -> LayerSpec:
        """How this family's layers are built from ``cfg``."""
        return LayerSpec()

    @classmethod
    def refusals(cls, cfg: ModelConfig, context_len: int) -> list[str]:
        """``field=value`` for each config.json field this family does not compute."""
        found = []
        if cfg.hidden_act not in ACTIVATIONS:
            found.append(f"hidden_act={cfg.hidden_act!r} "
                         f"(implemented: {', '.join(ACTIVATIONS)})")
        if cfg.mlp_bias:
            found.append("mlp_bias=True")
        if (cfg.sliding_window is not None and cfg.sliding_window < context_len
                and not cls.implements_sliding_window):
            found.append(f"sliding_window={cfg.sliding_window} (shorter than the context of "
                         f"{context_len} tokens; sliding-window attention is not implemented)")
        if cfg.rope_type not in ROPE_TYPES:
            found.append(f"rope_type={cfg.rope_type!r} (implemented: {', '.join(ROPE_TYPES)})")
        if cfg.partial_rotary_factor != 1.0:
            found.append(f"partial_rotary_factor={cfg.partial_rotary_factor}")
        if cfg.num_experts and not cls.implements_experts:
            found.append(f"{cfg.experts_field}={cfg.num_experts} (mixture of experts)")
        if cfg.shared_expert_intermediate_size:
            found.append(f"shared_expert_intermediate_size="
                         f"{cfg.shared_expert_intermediate_size} (shared experts)")
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(cfg, name) is not None:
                found.append(f"{name}={getattr(cfg, name)}")
        return found

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = rotary
        self.tp = tp or TensorParallel()
        self.vocab_start, rows = self.tp.vocab_rows(cfg.vocab_size)
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size)
        spec = self.layer_spec(cfg)
        self.windows = tuple(self.layer_window(cfg, i) for i in range(cfg.num_layers))
        self.layers = nn.ModuleList(
            self.layer_class(cfg, i, spec, self.tp, self.build_mlp(cfg, i), self.windows[i])
            for i in range(cfg.num_layers))
        self.norm = self.layer_class.norm_class(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head: Linear | TiedHead = (TiedHead(self.embed_tokens)
                                           if cfg.tie_word_embeddings
                                           else Linear(cfg.hidden_size, rows))
        self.op_names = OpNames(activation=cfg.hidden_act, norm="rms")
        self.ops = LayerOps(self.op_names)

    def build_mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """Layer ``layer``'s MLP: ``mlp(x, ops)``, all-reduced under tp, with an
        ``intermediate`` width (a family of experts returns its block on its layers)."""
        return GatedMLP(cfg, self.tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionContext) -> torch.Tensor:
        x = self._embed(input_ids)
        rotary = self.rotary.lookup(positions, x.dtype)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, rotary, attn, self.ops)
        if residual is None:
            return self.ops.norm(x, self.norm.weight, self.norm.eps)
        return self.ops.add_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        x = self.embed_tokens(torch.where(mine, local, 0)) * mine.unsqueeze(-1)
        return self.tp.all_reduce(x)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits = self.tp.gather_vocab(self.lm_head(hidden), self.config.vocab_size)
        return logits.float() if upcast else logits

    @contextlib.contextmanager
    def first_layers(self, count: int) -> Iterator[None]:
        """Within the block, the model's forwards run through its first ``count`` layers
        only (the embedding, the final norm and the head as always): the start-up warm-up's
        forward, whose every layer would touch the same activation sizes."""
        layers = self.layers
        self.layers = nn.ModuleList(list(layers)[:count])
        try:
            yield
        finally:
            self.layers = layers

    def warm_up_args(self) -> WarmUpArgs:
        layer = self.layers[0]
        assert isinstance(layer, DecoderLayer)
        return layer.warm_up_args()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and isinstance(self.lm_head, TiedHead):
                continue  # tied: the embedding is the head
            for fragment, (fused, part) in _STACKED.items():
                if f".{fragment}." in name:
                    module_name, _, kind = name.replace(fragment, fused).rpartition(".")
                    module = self.get_submodule(module_name)
                    assert isinstance(module, MergedLinear)
                    module.load(part, tensor, is_bias=kind == "bias")
                    loaded.add(f"{module_name}.{kind}#{part}")
                    break
            else:
                if name not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
                with torch.no_grad():
                    params[name].copy_(tensor)
                loaded.add(name)
        missing = [n for n in params if n not in loaded and not self._fused_loaded(n, loaded)]
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def rank_part(self, name: str, shape: tuple[int, ...]) -> Part:
        """Rows of column-parallel tensors, columns of row-parallel ones (their bias: rank 0)."""
        tp = self.tp
        name = name.removeprefix("model.")
        if tp.size == 1:
            return None
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return (0, self.vocab_start, self.vocab_start + self.embed_tokens.num_embeddings)
        if any(row in name for row in _ROW_PARALLEL):
            if name.endswith(".weight"):
                per = shape[1] // tp.size
                return (1, tp.rank * per, (tp.rank + 1) * per)
            return None if tp.rank == 0 else ZEROS
        if any(f".{fragment}." in name for fragment in _STACKED):
            per = shape[0] // tp.size
            return (0, tp.rank * per, (tp.rank + 1) * per)
        return None

    def _fused_loaded(self, name: str, loaded: set[str]) -> bool:
        module = self.get_submodule(name.rpartition(".")[0])
        if not isinstance(module, MergedLinear):
            return False
        return all(f"{name}#{i}" in loaded for i in range(len(module.sizes)))
