"""What the user names as a model, as a local Hugging Face directory: a directory, a GGUF
file (converted once), a hub id, or nothing (the embedded model). See docs/architecture.md,
'Model sources'."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from asyncinfer.cachedir import models_dir
from asyncinfer.errors import ModelNotFoundError
from asyncinfer.models.convert import converted_size, gguf_target, gguf_to_hf_dir
from asyncinfer.models.fetch import EMBEDDED_NAME, EMBEDDED_SHAPE, embedded_model_dir
from asyncinfer.models.progress import Progress, say

__all__ = ["EMBEDDED_NAME", "EMBEDDED_SHAPE", "ModelNotFoundError", "Progress",
           "cached_models", "converted_size", "embedded_model_dir",
           "gguf_to_hf_dir", "models_dir", "peek_config", "resolve_model", "say"]

_Kind = Literal["embedded", "dir", "gguf", "hub"]


def _source(model: str | os.PathLike[str] | None) -> tuple[_Kind, Path]:
    """What ``model`` names, checked as far as that takes no fetch."""
    if model is None or str(model) in (EMBEDDED_NAME, f"HuggingFaceTB/{EMBEDDED_NAME}"):
        return "embedded", models_dir() / EMBEDDED_NAME
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} is a directory but has no config.json")
        return "dir", path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {path} does not exist")
        return "gguf", path
    if path.exists() or str(model).startswith((".", "/", "~")):
        raise ModelNotFoundError(
            f"{model} is neither a model directory nor a .gguf file")
    return "hub", Path(str(model))


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """A local Hugging Face directory for ``model``, fetched or converted where needed."""
    kind, path = _source(model)
    if kind == "embedded":
        return embedded_model_dir()
    if kind == "gguf":
        return gguf_to_hf_dir(path)
    if kind == "hub":
        return _from_hub(str(model))
    return path


def peek_config(model: str | os.PathLike[str] | None) -> Mapping[str, Any] | None:
    """``model``'s config.json where it is at hand without a fetch or a conversion (the
    embedded model's known shape before its fetch), else None; raises as ``resolve_model``
    would before any fetch."""
    kind, path = _source(model)
    if kind == "gguf":
        path = gguf_target(path)
    elif kind == "hub":
        return None
    try:
        return dict(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError):
        return EMBEDDED_SHAPE if kind == "embedded" else None


def cached_models() -> list[Path]:
    """Every converted or fetched model directory in the cache."""
    return sorted(p.parent for p in models_dir().glob("*/config.json"))


def _from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - transformers depends on it
        raise ModelNotFoundError(f"cannot fetch {repo_id!r}: huggingface_hub missing") from exc
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:
        raise ModelNotFoundError(
            f"{repo_id!r} is not a local directory or .gguf file, and the model hub could not "
            f"be reached to fetch it ({type(exc).__name__}). Pass a local path, or omit "
            "--model to use the embedded SmolLM2-135M-Instruct.") from exc
