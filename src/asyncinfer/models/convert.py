"""GGUF to a Hugging Face directory (float32 safetensors and the tokenizer), once, cached."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from asyncinfer.cachedir import models_dir
from asyncinfer.errors import ConfigError
from asyncinfer.models.progress import Progress, format_size, say, step


def gguf_target(gguf: Path) -> Path:
    """Where the conversion of ``gguf`` is cached: keyed by its path, size and mtime."""
    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return models_dir() / f"gguf-{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def gguf_to_hf_dir(gguf: Path) -> Path:
    """Convert a GGUF file once (dequantized, safetensors) and cache it by content identity."""
    target = gguf_target(gguf)
    if not (target / "config.json").exists():
        convert_gguf(gguf, target)
    return target


def converted_size(gguf: Path) -> int | None:
    """Bytes of the float32 conversion of ``gguf``, from the tensor shapes in its header
    (None where that cannot be read)."""
    try:
        with open(gguf, "rb") as f:
            magic, version, tensors, fields = struct.unpack("<4sIQQ", f.read(24))
            if magic != b"GGUF" or version < 2:
                return None
            for _ in range(fields):  # skipped over: the metadata holds a whole vocabulary
                _skip_string(f)
                _skip_value(f, struct.unpack("<I", f.read(4))[0])
            weights = 0
            for _ in range(tensors):
                _skip_string(f)
                (dims,) = struct.unpack("<I", f.read(4))
                weights += math.prod(struct.unpack(f"<{dims}Q", f.read(8 * dims)))
                f.seek(12, os.SEEK_CUR)  # the tensor's type and offset
            return 4 * weights
    except (OSError, struct.error, KeyError, ValueError):
        return None


# Bytes of each GGUF scalar value type (8 is a string, 9 an array).
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _skip_string(f: IO[bytes]) -> None:
    (length,) = struct.unpack("<Q", f.read(8))
    f.seek(length, os.SEEK_CUR)


def _skip_value(f: IO[bytes], kind: int) -> None:
    if kind == 8:
        _skip_string(f)
    elif kind == 9:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _SCALARS:
            f.seek(_SCALARS[item] * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_value(f, item)
    else:
        f.seek(_SCALARS[kind], os.SEEK_CUR)


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize ``gguf`` into a Hugging Face directory at ``target``, saying what it costs
    in the cache first (refused where the disk lacks it) and how far it has got."""
    size = converted_size(gguf)
    if size is not None:
        free = shutil.disk_usage(target.parent).free
        if free < size * 1.05:
            raise ConfigError(
                f"converting {gguf.name} needs about {format_size(size)} in {target.parent}, "
                f"which has {format_size(free)} free; free some space, or point "
                "ASYNCINFER_CACHE at a larger disk")
    say("converting %s (GGUF) to safetensors once, into %s (%s)", gguf.name, target,
        f"about {format_size(size)}" if size is not None else "size unknown")
    start = time.monotonic()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_transformers_bars(gguf.name):
        with step("converting %s: reading the tokenizer", gguf.name):
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        with step("converting %s: reading and dequantizing the weights", gguf.name):
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:  # save_pretrained refuses a model still marked GGUF
            quantizer.remove_quantization_config(model)
        with step("converting %s: writing the safetensors", gguf.name):
            # Renamed into place when whole: an interrupted conversion never looks done, and
            # of two at once the first rename wins.
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
    written = sum(f.stat().st_size for f in target.iterdir() if f.is_file())
    say("converted %s in %.1f s: %s in %s", gguf.name, time.monotonic() - start,
        format_size(written), target)


@contextlib.contextmanager
def _quiet_transformers_bars(name: str) -> Iterator[None]:
    """transformers' own bars off (carriage returns in a log); its loop over the GGUF's
    tensors reported through :class:`Progress` instead."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    def dequantizing(items: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        items = list(items)
        return Progress(f"converting {name}: dequantizing", len(items),
                        unit="tensors").iterate(items)

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    original = getattr(gguf_utils, "tqdm", None)
    if original is not None:
        gguf_utils.tqdm = dequantizing
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original
        if bars:
            hf_logging.enable_progress_bar()
