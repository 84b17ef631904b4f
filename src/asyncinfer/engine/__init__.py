"""The model runners: the torch reference runner and the flashinfer runner for CUDA."""

from __future__ import annotations

from pathlib import Path

from asyncinfer.config import EngineConfig
from asyncinfer.engine.runner import ModelRunner


def create_runner(config: EngineConfig, model_dir: Path) -> ModelRunner:
    """The runner for ``config``'s attention backend (see ``EngineConfig``)."""
    if config.resolved_attention_backend == "flashinfer":
        from asyncinfer.engine.flashinfer_runner import FlashInferRunner

        return FlashInferRunner(config, model_dir)
    return ModelRunner(config, model_dir)
