"""The model runner (one for every attention backend) and its CUDA graphs and sampler."""

from __future__ import annotations

from pathlib import Path

from asyncinfer.config import EngineConfig
from asyncinfer.engine.runner import ModelRunner


def create_runner(config: EngineConfig, model_dir: Path) -> ModelRunner:
    """The runner for ``config`` (its backend: ``config.resolved_attention_backend``)."""
    return ModelRunner(config, model_dir)
