"""Frozen configs: what the model is (read from its config.json) and how the engine runs it.

Every engine option is declared once, as a field of :class:`EngineConfig` made by
:func:`option`: its default, its validation, and (as field metadata) the help text and the
choices that :mod:`asyncinfer.options` turns into command-line flags. Importing this module
does not import torch (``asyncinfer --help`` builds its parsers from these declarations);
the properties that need torch import it when called.
"""

# ruff: noqa: RUF009  (option() makes attrs fields; ruff takes it for a mutable default)

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, get_args

from attrs import NOTHING, Attribute, evolve, field, frozen

from asyncinfer.errors import ConfigError, UnsupportedModelError

if TYPE_CHECKING:
    import torch

# User's names of the supported dtypes → torch's attribute names.
_DTYPES = {
    "float32": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A torch dtype from a user's name for it ("bf16", "float32", ...)."""
    import torch

    if isinstance(name, torch.dtype):
        if name not in (torch.float32, torch.bfloat16, torch.float16):
            raise ConfigError(f"unsupported dtype {name}; use float32, bfloat16 or float16")
        return name
    return getattr(torch, _dtype_name(name))


def _dtype_name(name: str) -> str:
    """torch's name of a user's dtype name; ConfigError for one it does not know."""
    try:
        return _DTYPES[name.lower()]
    except (KeyError, AttributeError):
        raise ConfigError(
            f"dtype must be one of float32, bfloat16, float16 (or fp32, bf16, fp16, half), "
            f"got {name!r}") from None


EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""config.json's names for the expert count of a mixture-of-experts model."""


@frozen
class ModelConfig:
    """The shape of a decoder-only model and every config.json field that changes its
    computation (a family refuses the values it does not implement: ``models.registry``)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    hf_config: Any = field(eq=False, repr=False)
    hidden_act: str = "silu"
    mlp_bias: bool = False
    sliding_window: int | None = None  # None: no layer attends through a window
    rope_type: str = "default"
    partial_rotary_factor: float = 1.0
    num_experts: int = 0
    experts_field: str = ""
    experts_per_token: int = 0          # num_experts_per_tok: the top-k of the router
    norm_topk_prob: bool = False        # renormalise the top-k routing weights to sum to 1
    moe_intermediate_size: int = 0      # an expert's width (0: intermediate_size)
    decoder_sparse_step: int = 1        # every this many layers is a mixture of experts
    mlp_only_layers: tuple[int, ...] = ()  # layers with a dense MLP whatever the step
    shared_expert_intermediate_size: int = 0
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None  # None: scores scaled by head_dim ** -0.5

    @property
    def attention_scale(self) -> float:
        """What q . k is multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def sharded(self, ranks: int) -> ModelConfig:
        """The shape one of ``ranks`` tensor-parallel ranks holds: its share of the attention
        heads, KV heads and MLP width (the vocabulary is split by the model itself)."""
        if ranks == 1:
            return self
        return evolve(self, num_heads=self.num_heads // ranks,
                      num_kv_heads=self.num_kv_heads // ranks,
                      intermediate_size=self.intermediate_size // ranks,
                      moe_intermediate_size=self.moe_intermediate_size // ranks)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read config.json of a local model directory."""
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(path, local_files_only=True)
        archs = getattr(hf, "architectures", None) or []
        if not archs:
            raise UnsupportedModelError(f"{path}/config.json names no architecture")
        heads = hf.num_attention_heads
        rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
        experts = [(n, int(getattr(hf, n, 0) or 0)) for n in EXPERT_FIELDS]
        experts_field, num_experts = max(experts, key=lambda e: e[1])
        return cls(
            architecture=archs[0],
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            hf_config=hf,
            hidden_act=str(getattr(hf, "hidden_activation", None)  # Gemma's name for it
                           or getattr(hf, "hidden_act", "silu")),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            sliding_window=_sliding_window(hf),
            rope_type=_rope_type(rope),
            partial_rotary_factor=float(getattr(hf, "partial_rotary_factor", None)
                                        or rope.get("partial_rotary_factor") or 1.0),
            num_experts=num_experts,
            experts_field=experts_field if num_experts else "",
            experts_per_token=int(getattr(hf, "num_experts_per_tok", 0) or 0),
            norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
            moe_intermediate_size=int(getattr(hf, "moe_intermediate_size", 0) or 0),
            decoder_sparse_step=int(getattr(hf, "decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(getattr(hf, "mlp_only_layers", None) or ()),
            shared_expert_intermediate_size=int(
                getattr(hf, "shared_expert_intermediate_size", 0) or 0),
            final_logit_softcapping=getattr(hf, "final_logit_softcapping", None),
            attn_logit_softcapping=getattr(hf, "attn_logit_softcapping", None),
            query_pre_attn_scalar=getattr(hf, "query_pre_attn_scalar", None),
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V, all layers, for one token."""
        import torch

        item = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * item


def _rope_type(rope: Mapping[str, Any]) -> str:
    """The rope type of config.json's rope parameters ("per-layer": one set per layer type)."""
    if rope and all(isinstance(v, Mapping) for v in rope.values()):
        return "per-layer"
    return str(rope.get("rope_type") or rope.get("type") or "default")


def _sliding_window(hf: Any) -> int | None:
    """The attention window some layer uses, or None (off, or no layer of sliding type)."""
    window = getattr(hf, "sliding_window", None)
    if window is None or getattr(hf, "use_sliding_window", True) is False:
        return None
    types = getattr(hf, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window)


# ---- declaring an option ---------------------------------------------------------------------

OPTION = "asyncinfer.option"
"""The key of an :class:`OptionInfo` in an :class:`EngineConfig` field's metadata."""


@frozen
class OptionInfo:
    """What an option's field carries beyond its name, type and default: its help text, and
    the few things a command-line flag for it needs that the type does not say."""

    help: str
    choices: tuple[str, ...] | None = None
    means: str | None = None    # what a default of None stands for
    flag: str | None = None     # the flag's spelling, when not --field-name
    pairs: bool = False         # a mapping, given as repeated KEY=VALUE flags


Validator = Callable[[Any, "Attribute[Any]", Any], None]


def option(default: Any = NOTHING, *, help: str, means: str | None = None, choices: Any = None,
           check: Validator | None = None, factory: Callable[[], Any] | None = None,
           converter: Callable[[Any], Any] | None = None, hash: bool | None = None,
           flag: str | None = None, pairs: bool = False) -> Any:
    """An engine option: an attrs field whose metadata holds its :class:`OptionInfo`.

    ``means`` says what a default of None stands for (the help shows it as the default).

    ``choices`` is the ``Literal`` type the field is annotated with: the accepted values
    are read from it, so the annotation, the check that rejects any other value with a
    ConfigError, and a flag's ``choices`` all come from one spelling of them. ``check`` is
    a further attrs validator.
    """
    values = tuple(get_args(choices)) if choices is not None else None
    validators = [v for v in (_one_of(values) if values else None, check) if v is not None]
    info = OptionInfo(help=help, choices=values, means=means, flag=flag, pairs=pairs)
    return field(default=default, factory=factory, validator=validators or None,
                 converter=converter, hash=hash, metadata={OPTION: info})


def _one_of(values: tuple[str, ...]) -> Validator:
    def check(_: object, attribute: Attribute[Any], value: object) -> None:
        if value not in values:
            raise ConfigError(f"{attribute.name} must be one of {', '.join(values)}, "
                              f"got {value!r}")
    return check


def _positive(_: object, attribute: Attribute[Any], value: int | None) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"{attribute.name} must be >= 1, got {value}")


def _not_negative(_: object, attribute: Attribute[Any], value: int) -> None:
    if value < 0:
        raise ConfigError(f"{attribute.name} must be >= 0, got {value}")


def _above_zero(_: object, attribute: Attribute[Any], value: float | None) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"{attribute.name} must be > 0, got {value}")


def _fraction(_: object, attribute: Attribute[Any], value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ConfigError(f"{attribute.name} must be in (0, 1], got {value}")


def _dtype(_: object, attribute: Attribute[Any], value: Any) -> None:
    if isinstance(value, str):
        _dtype_name(value)
    else:  # a torch.dtype: torch is imported already
        parse_dtype(value)


def _device(_: object, attribute: Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise ConfigError(f"{attribute.name} must be 'cpu' or 'cuda[:N]', got {value!r}")


def _policy_name(_: object, attribute: Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{attribute.name} must be a registered policy's name, got {value!r}")


def _read_only(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """A frozen config's mapping: a read-only copy."""
    return MappingProxyType(dict(value or {}))


# The values of the options that take one of a few: the field's annotation, its check and
# its flag's choices all read them from here.
LoadFormat = Literal["auto", "dummy"]
CacheType = Literal["radix", "naive"]
CpuFp32Compute = Literal["auto", "on", "off"]
AttentionBackend = Literal["auto", "torch", "flashinfer"]
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]


@frozen
class EngineConfig:
    """How to run a model: device, dtype, KV cache geometry, limits and scheduling.

    Each field is one option of ``LLM(...)`` and ``AsyncEngine(...)`` and, through
    :mod:`asyncinfer.options`, one flag of ``asyncinfer serve``, ``generate`` and ``bench``,
    with the help text declared here. See docs/architecture.md, 'Engine options'.
    """

    model: str | None = option(None, help="local model directory, .gguf file or hub id",
                               means="the embedded SmolLM2-135M-Instruct")
    device: str = option("cpu", check=_device, help="cpu or cuda[:N]")
    dtype: str = option("bfloat16", check=_dtype,
                        help="the dtype of weights, activations and the KV cache: float32, "
                             "bfloat16 or float16 (or fp32, bf16, fp16, half)")
    load_format: LoadFormat = option("auto", choices=LoadFormat,
                                     help="dummy: random weights of the real shapes "
                                          "(benchmarks)")
    page_size: int = option(16, check=_positive, help="tokens per KV page")
    max_running_requests: int = option(64, check=_positive,
                                       help="request slots (rows of the page table)")
    max_seq_len: int | None = option(None, check=_positive, help="longest prompt + output",
                                     means="the model's context, at most 8192")
    kv_cache_gb: float | None = option(
        None, check=_above_zero,
        help="KV cache size in GiB",
        means="on CPU room for max_running_requests sequences of max_seq_len, at most an "
              "eighth of the memory available; on CUDA what gpu_memory_utilization leaves "
              "after weights and activations")
    kv_cache_dtype: KVCacheDtype = option(
        "auto", choices=KVCacheDtype,
        help="what the KV cache stores: auto (the model's dtype; float32 where the CPU "
             "computes half precision in float32) or FP8, half the bytes of bf16: fp8_e4m3 "
             "(fp8 is its alias) or fp8_e5m2, with a per-tensor scale of 1 and values "
             "beyond the format's range saturated; not with batch_invariant. On a CPU it "
             "runs through torch's attention, not the compiled kernels")
    num_pages: int | None = option(None, check=_positive,
                                   help="KV cache size in pages (overrides kv_cache_gb)",
                                   means="from kv_cache_gb")
    seed: int = option(0, help="seed of the engine's sampling for requests that set none, "
                               "and of dummy weights")
    cache_type: CacheType = option("radix", choices=CacheType,
                                   help="radix shares prompt prefixes between requests; "
                                        "naive does not")
    cpu_fp32_compute: CpuFp32Compute = option(
        "auto", choices=CpuFp32Compute,
        help="on a CPU, run a bf16/fp16 model's matrix products and attention in float32 "
             "kernels: when the CPU lacks half-precision units (auto), always or never")
    cpu_kernels: bool = option(
        True, help="on a CPU, compile kernels for this CPU (needs a C compiler): decode "
                   "attention that reads K and V in place in the paged cache, the layer's "
                   "norms, rotary and SiLU in bf16, greedy argmax and structured output's "
                   "mask; off: torch's ops and xgrammar's mask")
    cpu_threads: int | None = option(
        None, check=_positive,
        help="on a CPU, the threads each rank computes with (torch's and the kernels' "
             "OpenMP threads)",
        means="the cores the process may use (its affinity, at most its cgroup's CPU "
              "quota) shared out over the ranks; OMP_NUM_THREADS where it is set")
    batch_invariant: bool | None = option(
        None, help="make each request's tokens and logprobs independent of its batch, its "
                   "prefill chunks and the prefix cache: every product, attention and norm "
                   "reduces in one fixed order per row (bf16 on a CPU with AVX-512, AMX or "
                   "AVX2, or CUDA through Triton; dense models; on: refused elsewhere)",
        means="on where it costs nothing measured: a bf16 dense model on an AVX-512 CPU "
              "without AMX; off elsewhere (CUDA included)")
    kv_events: str | None = option(
        None, means="off",
        help="publish the prefix cache's stored and evicted pages as KV-cache events in "
             "vLLM's schema over ZeroMQ, for prefix-aware routers: an endpoint (e.g. "
             "tcp://*:5557) or vLLM's --kv-events-config JSON (endpoint, replay_endpoint, "
             "topic, buffer_steps, hwm, max_queue_size)")
    max_extend_tokens: int = option(4096, check=_positive,
                                    help="prefill tokens one round may compute")
    warm_up: bool = option(True, help="on a CPU, compute one forward of max_extend_tokens "
                                      "prompt tokens at start-up and drop it, so that the "
                                      "first requests find the memory a full round touches "
                                      "already in place")
    chunked_prefill: bool = option(True, help="split a prompt longer than max_extend_tokens "
                                              "across rounds (off: refuse it)")
    gpu_memory_utilization: float = option(
        0.9, check=_fraction,
        help="share of GPU memory the engine may hold; the KV cache takes what weights and "
             "activations leave")
    attention_backend: AttentionBackend = option(
        "auto", choices=AttentionBackend,
        help="flashinfer (CUDA, bf16/fp16), torch (SDPA, the reference) or auto: "
             "flashinfer on CUDA when installed")
    tensor_parallel_size: int = option(
        1, check=_positive, flag="--tp",
        help="ranks one model is split over, one process each (started by the engine, "
             "or joined from torch.distributed's default group when one is set up)")
    tp_guard_interval: int = option(
        16, check=_not_negative,
        help="compare the tensor-parallel ranks' batches every this many rounds (1: every "
             "round, 0: never)")
    cuda_graph: bool = option(True, help="replay decode as CUDA graphs (flashinfer backend); "
                                         "off: run it eagerly")
    cuda_graph_max_bs: int | None = option(None, check=_positive,
                                           help="largest decode batch captured as a CUDA "
                                                "graph", means="the running limit")
    cuda_graph_max_prefill_tokens: int = option(
        2048, check=_not_negative,
        help="largest prefill or mixed batch, in tokens, captured as CUDA graphs (0: prefill "
             "runs eagerly)")
    torch_compile: bool = option(True, help="fuse norms, rotary, SiLU and sampling with "
                                            "torch.compile (CUDA, half precision); off: "
                                            "separate eager kernels")
    freeze_gc: bool | None = option(None, help="after start-up, take every object alive out "
                                               "of the garbage collector's reach",
                                    means="on CUDA")
    policy: str = option("prefill_first", check=_policy_name,
                         help="scheduling policy (see `asyncinfer policies`)")
    policy_options: Mapping[str, Any] = option(
        factory=dict, converter=_read_only, hash=False, flag="--policy-opt", pairs=True,
        help="an option of the policy (repeatable), e.g. --policy-opt aging=0.5",
        means="the policy's own")
    overlap: bool = option(True, help="schedule the next batch while one runs")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of weights, activations and the KV cache."""
        return parse_dtype(self.dtype)

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype | None:
        """The FP8 dtype ``kv_cache_dtype`` names; None for auto."""
        import torch

        return {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                "fp8_e5m2": torch.float8_e5m2}.get(self.kv_cache_dtype)

    @property
    def fp32_kernels(self) -> bool:
        """Whether half-precision values go through float32 kernels (see the docstring)."""
        import torch

        if not self.device.startswith("cpu") or self.torch_dtype == torch.float32:
            return False
        if self.cpu_fp32_compute != "auto":
            return self.cpu_fp32_compute == "on"
        return not _cpu_has_native(self.torch_dtype)

    @property
    def is_cuda(self) -> bool:
        """Whether the engine runs on a CUDA device."""
        return self.device.startswith("cuda")

    @property
    def compiles(self) -> bool:
        """Whether the engine runs its fused layer and sampling ops through torch.compile."""
        import torch

        return self.torch_compile and self.is_cuda and self.torch_dtype != torch.float32

    @property
    def freezes_gc(self) -> bool:
        """Whether the engine freezes the heap it starts with (``freeze_gc``)."""
        return self.is_cuda if self.freeze_gc is None else self.freeze_gc

    @property
    def resolved_attention_backend(self) -> Literal["torch", "flashinfer"]:
        """The backend "auto" stands for here: flashinfer on CUDA when importable."""
        if self.attention_backend != "auto":
            return self.attention_backend
        if self.batch_invariant and self.is_cuda:  # its attention kernel is the torch one's
            return "torch"
        import torch

        if (self.is_cuda and self.torch_dtype != torch.float32
                and importlib.util.find_spec("flashinfer") is not None):
            return "flashinfer"
        return "torch"

    def context_len(self, model: ModelConfig) -> int:
        """The longest sequence (prompt + output) a request may reach."""
        cap = self.max_seq_len or min(model.max_position_embeddings, 8192)
        return min(cap, model.max_position_embeddings)


def _cpu_has_native(dtype: torch.dtype) -> bool:
    """True when this CPU multiplies ``dtype`` in hardware (AVX-512 BF16/FP16 or AMX)."""
    import torch

    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return True  # unknown platform: trust torch's own kernels
    wanted = {"avx512_bf16", "amx_bf16"} if dtype == torch.bfloat16 else {"avx512_fp16",
                                                                            "amx_fp16"}
    return bool(flags & wanted)
