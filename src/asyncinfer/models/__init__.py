"""Model implementations, looked up by the architecture name in config.json."""

from __future__ import annotations

from asyncinfer.models.registry import MODEL_REGISTRY, build_model, check_model

__all__ = ["MODEL_REGISTRY", "build_model", "check_model"]
