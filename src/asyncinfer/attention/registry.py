"""Attention backends by name: what ``EngineConfig.attention_backend`` resolves to."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from asyncinfer.attention.base import AttentionBackendClass
from asyncinfer.attention.flashinfer_backend import FlashInferBackend
from asyncinfer.attention.torch_backend import TorchBackend
from asyncinfer.errors import ConfigError

BACKENDS: Mapping[str, AttentionBackendClass] = MappingProxyType({
    "torch": TorchBackend,
    "flashinfer": FlashInferBackend,
})


def backend_class(name: str) -> AttentionBackendClass:
    """The backend class registered as ``name``; ConfigError for an unknown name."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ConfigError(f"unknown attention backend {name!r}; use one of "
                          f"{', '.join(BACKENDS)}") from None
