"""Frozen configs: what the model is (read from its config.json) and how the engine runs it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal

import torch
from attrs import field, frozen

from asyncinfer.errors import ConfigError, UnsupportedModelError

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A torch dtype from a user's name for it ("bf16", "float32", ...)."""
    if isinstance(name, torch.dtype):
        if name not in _DTYPES.values():
            raise ConfigError(f"unsupported dtype {name}; use float32, bfloat16 or float16")
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ConfigError(
            f"unknown dtype {name!r}; use one of float32, bfloat16, float16") from None


@frozen
class ModelConfig:
    """The shape of a decoder-only model, read from a Hugging Face config.json."""

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

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read config.json of a local model directory."""
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(path, local_files_only=True)
        archs = getattr(hf, "architectures", None) or []
        if not archs:
            raise UnsupportedModelError(f"{path}/config.json names no architecture")
        heads = hf.num_attention_heads
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
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V, all layers, for one token."""
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * item


def _positive(_: object, attribute: Any, value: int | None) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"{attribute.name} must be >= 1, got {value}")


@frozen
class EngineConfig:
    """How to run a model: device, dtype, KV cache geometry and limits.

    ``kv_cache_gb`` sizes the page pool from a memory budget; ``num_pages`` overrides it.
    Unset on a GPU, the pool takes what ``gpu_memory_utilization`` (the fraction of the
    device's memory the engine may hold in all) leaves after weights and activations; on a
    CPU it defaults to 2 GiB.
    ``attention_backend`` is "flashinfer" (CUDA only), "torch" (SDPA, the reference) or
    "auto": flashinfer on CUDA when it is installed (and the dtype is not float32, which
    flashinfer has no kernels for), else torch. ``cuda_graph`` captures
    decode at a ladder of batch sizes up to ``cuda_graph_max_bs`` (default: the running
    limit) with the flashinfer backend; larger batches run eagerly. ``torch_compile`` fuses
    the elementwise work between matrix products (norms, rotary, SiLU, sampling) with
    torch.compile where that pays: on CUDA in half precision (elsewhere it is ignored).
    ``max_seq_len`` defaults to the model's context, capped at 8192 tokens.
    ``max_extend_tokens`` is the prefill token budget of one round; with ``chunked_prefill``
    a longer prompt is split across rounds, without it such a prompt is refused.
    ``cpu_fp32_compute`` runs a bf16/fp16 model's matrix products and attention in float32
    kernels on a CPU that lacks native half-precision units ("auto"), always ("on") or
    never ("off"); values stay half-precision, only the kernels differ.
    ``freeze_gc`` moves everything alive once the engine is built (modules, compiled
    graphs, weights' wrappers: millions of objects) out of the garbage collector's reach
    with ``gc.freeze()``; a full collection over them stalled a GPU engine for a third of a
    second mid-run. None: on CUDA, where such a stall idles the device. Closing the engine
    unfreezes the heap, so what it held can be collected.
    """

    model: str | None = None
    device: str = "cpu"
    dtype: str = "bfloat16"
    load_format: Literal["auto", "dummy"] = "auto"
    page_size: int = field(default=16, validator=_positive)
    max_running_requests: int = field(default=64, validator=_positive)
    max_seq_len: int | None = field(default=None, validator=_positive)
    kv_cache_gb: float | None = None
    num_pages: int | None = field(default=None, validator=_positive)
    seed: int = 0
    cache_type: Literal["radix", "naive"] = "radix"
    cpu_fp32_compute: Literal["auto", "on", "off"] = "auto"
    max_extend_tokens: int = field(default=4096, validator=_positive)
    chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9
    attention_backend: Literal["auto", "torch", "flashinfer"] = "auto"
    cuda_graph: bool = True
    cuda_graph_max_bs: int | None = field(default=None, validator=_positive)
    torch_compile: bool = True
    freeze_gc: bool | None = None

    def __attrs_post_init__(self) -> None:
        parse_dtype(self.dtype)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1], got "
                              f"{self.gpu_memory_utilization}")
        if self.attention_backend not in ("auto", "torch", "flashinfer"):
            raise ConfigError("attention_backend must be auto, torch or flashinfer, got "
                              f"{self.attention_backend!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ConfigError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.cpu_fp32_compute not in ("auto", "on", "off"):
            raise ConfigError(
                f"cpu_fp32_compute must be auto, on or off, got {self.cpu_fp32_compute!r}")
        if self.cache_type not in ("radix", "naive"):
            raise ConfigError(f"cache_type must be 'radix' or 'naive', got {self.cache_type!r}")
        if not self.device.startswith(("cpu", "cuda")):
            raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of weights, activations and the KV cache."""
        return parse_dtype(self.dtype)

    @property
    def fp32_kernels(self) -> bool:
        """Whether half-precision values go through float32 kernels (see the docstring)."""
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
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return True  # unknown platform: trust torch's own kernels
    wanted = {"avx512_bf16", "amx_bf16"} if dtype == torch.bfloat16 else {"avx512_fp16",
                                                                            "amx_fp16"}
    return bool(flags & wanted)
