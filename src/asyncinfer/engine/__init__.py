"""The model runner: one ``ModelRunner`` for every attention backend (see
``asyncinfer.attention.registry``), with decode CUDA graphs for the backends that can be
captured."""

from __future__ import annotations

from pathlib import Path

from asyncinfer.config import EngineConfig
from asyncinfer.engine.runner import ModelRunner


def create_runner(config: EngineConfig, model_dir: Path) -> ModelRunner:
    """The runner for ``config``; its attention backend is ``config.resolved_attention_backend``
    (see ``EngineConfig``)."""
    return ModelRunner(config, model_dir)
