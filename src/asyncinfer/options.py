"""Command-line flags for engine options, generated from :class:`EngineConfig`'s fields.

Each option is declared once, as an ``EngineConfig`` field (see
:func:`asyncinfer.config.option`); ``serve``, ``generate`` and ``bench`` add the flags of
the options they take with :func:`add_engine_arguments`, and turn what the user gave back
into keyword options with :func:`engine_options`. A flag is ``--field-name`` (dashes for
underscores) unless the field names another spelling; its type comes from the field's
annotation, its help and choices from the field's metadata. A boolean option gets a pair,
``--x`` and ``--no-x``. Every flag defaults to None, so only the flags given are passed on
and the engine's own defaults apply to the rest (the help shows them).

Before a command loads anything, :func:`preflight` builds the :class:`EngineConfig` the
flags describe (each option's own check, and the policy's name) and :func:`check_environment`
refuses what this machine cannot run (a CUDA device without a CUDA build of torch or a
visible GPU, more GPUs than there are, a backend that cannot run here, a tensor-parallel
split the model's heads do not divide); :func:`in_flag_terms` names options in a message as
the user typed them. :func:`configure_logging` sets up every process of a command alike.

Nothing here imports torch at import time: ``asyncinfer --help`` builds these parsers.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import re
import types
import typing
import warnings
from collections.abc import Collection, Mapping
from typing import Any

import attrs

from asyncinfer.config import OPTION, EngineConfig, OptionInfo
from asyncinfer.errors import ConfigError, ModelNotFoundError

__all__ = ["add_engine_arguments", "check_environment", "configure_logging",
           "engine_option_names", "engine_options", "flag", "in_flag_terms", "preflight"]

logger = logging.getLogger(__name__)

# The namespace attribute that lists the engine options a parser declared.
_DECLARED = "engine_option_names"


def engine_option_names() -> tuple[str, ...]:
    """Every engine option, in declaration order."""
    return tuple(a.name for a in attrs.fields(EngineConfig))


def add_engine_arguments(parser: argparse.ArgumentParser, *,
                         only: Collection[str] | None = None, exclude: Collection[str] = (),
                         title: str | None = None,
                         defaults_here: Mapping[str, str] | None = None) -> None:
    """Add a flag for each engine option (those in ``only`` if given, less ``exclude``).

    ``title`` puts the flags in an argument group of that name. ``defaults_here`` maps an
    option to what this command uses when its flag is not given, where that is not the
    engine's default (the command supplies it; the help shows it as the default).
    """
    names = [n for n in (only if only is not None else engine_option_names())
             if n not in exclude]
    unknown = sorted(set(names) - set(engine_option_names()))
    if unknown:
        raise ValueError(f"not engine options: {', '.join(unknown)}")
    group: Any = parser.add_argument_group(title) if title else parser
    fields = attrs.fields_dict(EngineConfig)
    here = defaults_here or {}
    for name in names:
        flags, kwargs = _flag(fields[name], _types()[name], here.get(name))
        group.add_argument(*flags, **kwargs)
    parser.set_defaults(**{_DECLARED: tuple(names)})


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineConfig`` keyword options the flags in ``args`` set: those given, each
    as the option's value (repeated ``KEY=VALUE`` flags as a mapping, see
    :func:`~asyncinfer.policies.registry.parse_policy_options`; ConfigError if malformed).
    """
    from asyncinfer.policies.registry import parse_policy_options

    fields = attrs.fields_dict(EngineConfig)
    names = getattr(args, _DECLARED, None)
    if names is None:  # a namespace not parsed by such a parser: read every option's name
        names = engine_option_names()
    options: dict[str, Any] = {}
    for name in names:
        value = getattr(args, name, None)
        if value is None:
            continue
        options[name] = parse_policy_options(value) if _info(fields[name]).pairs else value
    return options


def _info(field: attrs.Attribute[Any]) -> OptionInfo:
    info = field.metadata.get(OPTION)
    if not isinstance(info, OptionInfo):
        raise TypeError(f"EngineConfig.{field.name} is not declared with option()")
    return info


@functools.cache
def _types() -> dict[str, Any]:
    """Each field's annotation, evaluated (the module's annotations are strings)."""
    return typing.get_type_hints(EngineConfig)


def _flag(field: attrs.Attribute[Any], annotation: Any,
          default_here: str | None) -> tuple[list[str], dict[str, Any]]:
    """The option strings and ``add_argument`` keywords of one option's flag."""
    info = _info(field)
    kind = _bare(annotation)
    flag = info.flag or "--" + field.name.replace("_", "-")
    shown = default_here or info.means
    if shown is None and isinstance(field.default, (str, int, float)):  # not a factory
        shown = ("on" if field.default else "off") if kind is bool else str(field.default)
    help_text = info.help + (f" (default: {shown})" if shown is not None else "")
    kwargs: dict[str, Any] = {"dest": field.name, "default": None,
                              "help": help_text.replace("%", "%%")}
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
        return [flag], kwargs
    if info.pairs:
        kwargs.update(action="append", metavar="KEY=VALUE")
    elif kind in (int, float):
        kwargs["type"] = kind
    elif kind is not str:
        raise TypeError(f"EngineConfig.{field.name}: no flag for a {annotation!r}")
    if info.choices is not None:
        kwargs["choices"] = info.choices
    return [flag], kwargs


def _bare(annotation: Any) -> Any:
    """The type a flag parses, from an option's annotation: ``int | None`` → int, a Literal
    of strings → str, a mapping (given as repeated ``key=value`` strings) → str."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _bare(kinds[0]) if len(kinds) == 1 else annotation
    if origin is typing.Literal:
        return str
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        return str
    return annotation


# ---- before anything loads --------------------------------------------------------------------

def flag(name: str) -> str:
    """The command-line flag of engine option ``name`` ("--page-size", "--tp", ...)."""
    return _flags()[name]


@functools.cache
def _flags() -> dict[str, str]:
    return {field.name: _info(field).flag or "--" + field.name.replace("_", "-")
            for field in attrs.fields(EngineConfig)}


# An option's name, possibly with "=value" after it, not inside a path or a longer name.
_NAMED = re.compile(r"(?<![\w./-])([a-z][a-z0-9_]*)(?:=('[^']*'|\"[^\"]*\"|[\w.:+-]+))?"
                    r"(?![\w/])")


def in_flag_terms(message: str) -> str:
    """``message`` with the engine options it names spelled as their flags:
    "page_size must be >= 1" becomes "--page-size must be >= 1", "attention_backend='torch'"
    "--attention-backend torch", "cuda_graph=False" "--no-cuda-graph". A one-word name
    ("device", "model") counts only where it is given a value or said to be wrong ("must"):
    elsewhere it is an ordinary word."""
    flags = _flags()

    def spell(match: re.Match[str]) -> str:
        name, value = match.group(1), match.group(2)
        if name not in flags or ("_" not in name and value is None
                                 and not message[match.end():].startswith(" must")):
            return match.group(0)
        spelled = flags[name]
        if value is None:
            return spelled
        value = value.strip("'\"")
        if value in ("True", "False"):
            return spelled if value == "True" else "--no-" + spelled[2:]
        return f"{spelled} {value}"

    return _NAMED.sub(spell, message)


def preflight(args: argparse.Namespace,
              defaults: Mapping[str, Any] | None = None) -> EngineConfig:
    """The engine config the flags in ``args`` describe (over a command's own
    ``defaults``), every option checked before anything loads, without importing torch."""
    config = EngineConfig(**{**(defaults or {}), **engine_options(args)})
    _check_policy(config)
    return config


def _check_policy(config: EngineConfig) -> None:
    """The policy's name and option names, checked without building it: the process that
    runs it builds it, once, and judges the values."""
    from asyncinfer.policies.registry import available_policies

    name, given = config.policy, sorted(config.policy_options)
    found = available_policies()
    if name not in found:
        raise ConfigError(f"{flag('policy')} {name}: unknown policy {name!r}; installed "
                          f"policies: {', '.join(found) or '(none)'}")
    try:
        known = getattr(found[name].load(), "options", None)
    except Exception as exc:
        raise ConfigError(f"{flag('policy')} {name}: failed to load: "
                          f"{type(exc).__name__}: {exc}") from None
    unknown = [key for key in given if isinstance(known, Mapping) and key not in known]
    if unknown:
        raise ConfigError(f"{flag('policy')} {name}: policy {name!r} has no option "
                          f"{unknown[0]!r}; its options: {', '.join(known or ()) or '(none)'}")


def check_environment(config: EngineConfig, replicas: int = 1) -> None:
    """Refuse, with one ConfigError naming the flags, what this machine cannot run
    ``config`` (``replicas`` data-parallel copies of it, on CUDA each on GPUs of its own)
    with, before anything is fetched or loaded: a model path that does not exist; a CUDA
    device where torch is a CPU-only build, sees no GPU, or has fewer GPUs than the
    tensor-parallel ranks of every replica take; an attention backend that cannot run on
    the device and dtype (the backend's own check: flashinfer needs CUDA, flashinfer-python,
    half precision); a tensor-parallel size the model's heads or MLP do not divide (read
    from its config.json where it is at hand). Warns where CUDA attention falls back to the
    torch backend because flashinfer is not installed."""
    import torch

    from asyncinfer.attention.registry import backend_class
    from asyncinfer.models.source import peek_config

    try:
        shape = peek_config(config.model)
    except ModelNotFoundError as exc:
        raise ConfigError(f"{flag('model')}: {exc}") from None
    if config.is_cuda:
        _check_gpus(config, replicas)
    backend = config.resolved_attention_backend
    backend_class(backend).check(torch.device(config.device), config.torch_dtype)
    if (config.is_cuda and backend == "torch" and config.attention_backend == "auto"
            and config.torch_dtype != torch.float32):
        logger.warning("flashinfer is not installed: attention on %s runs on the torch "
                       "backend, without CUDA graphs (pip install -e .[cuda] for flashinfer)",
                       config.device)
    if config.tensor_parallel_size > 1 and shape is not None:
        _check_split(config.tensor_parallel_size, shape)


def _check_gpus(config: EngineConfig, replicas: int) -> None:
    """A CUDA build of torch that sees every GPU the ranks of every replica take."""
    import torch

    device, version = config.device, torch.__version__
    if not torch.backends.cuda.is_built():
        raise ConfigError(
            f"{flag('device')} {device}: the installed torch {version} is a CPU-only build; "
            "install a CUDA build of torch (https://pytorch.org/get-started/locally/), then "
            f"`pip install -e .[cuda]` for flashinfer, or use {flag('device')} cpu")
    with warnings.catch_warnings(record=True) as caught:  # a driver problem is a warning
        warnings.simplefilter("always")
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        why = f" ({str(caught[0].message).strip().splitlines()[0]})" if caught else ""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hidden = (f" and CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "")
        raise ConfigError(
            f"{flag('device')} {device}: torch {version} (CUDA {torch.version.cuda}) sees no "
            f"GPU{why}; check the driver with nvidia-smi{hidden}, or use {flag('device')} cpu")
    first = int(device.partition(":")[2] or 0)
    seen = f"{gpus} GPU{'s are' if gpus > 1 else ' is'} visible (cuda:0" + (
        f" to cuda:{gpus - 1})" if gpus > 1 else ")")
    if first >= gpus:
        raise ConfigError(f"{flag('device')} {device}: no such GPU; {seen}")
    ranks = config.tensor_parallel_size
    needed = ranks * replicas
    if first + needed > gpus:
        asked = f"{flag('tensor_parallel_size')} {ranks}" + (
            f" with --dp {replicas}" if replicas > 1 else "")
        raise ConfigError(
            f"{asked} takes {needed} GPUs, cuda:{first} to cuda:{first + needed - 1}, but "
            f"{seen}; lower {flag('tensor_parallel_size')}"
            + (" or --dp" if replicas > 1 else "")
            + (f", or start from a lower {flag('device')}" if first else ""))


def _check_split(ranks: int, shape: Mapping[str, Any]) -> None:
    """The model's heads, KV heads and MLP width divide by the tensor-parallel size."""
    from asyncinfer.distributed.parallel import TensorParallel

    heads, width = shape.get("num_attention_heads"), shape.get("intermediate_size")
    kv_heads = shape.get("num_key_value_heads") or heads
    if not (isinstance(heads, int) and isinstance(kv_heads, int) and isinstance(width, int)
            and min(heads, kv_heads, width) > 0):
        return  # not a shape this check knows: the engine checks it once it reads it
    try:
        TensorParallel(0, ranks).check(heads, kv_heads, width)
    except ConfigError as exc:
        common = math.gcd(heads, kv_heads, width)
        sizes = [str(n) for n in range(1, common + 1) if common % n == 0]
        raise ConfigError(f"{exc}; it splits over {flag('tensor_parallel_size')} "
                          f"{', '.join(sizes[:-1]) + ' or ' if len(sizes) > 1 else ''}"
                          f"{sizes[-1]}") from None


# ---- logging ----------------------------------------------------------------------------------

class _Plain(logging.Formatter):
    """A line as a user reads it: "asyncinfer: message" for asyncinfer's own lines,
    "asyncinfer: warning: message" above INFO, another library's under its name."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        source = "asyncinfer" if record.name.partition(".")[0] == "asyncinfer" else record.name
        level = "" if record.levelno <= logging.INFO else record.levelname.lower() + ": "
        return f"{source}: {level}{text}"


def configure_logging(verbose: bool, process: str = "") -> None:
    """How every process of a command logs, to stderr. By default asyncinfer's own INFO
    lines show, plain (the start-up's steps and progress, the ready banner) and other
    libraries' only from WARNING; ``verbose`` (-v) shows every library's INFO lines with
    their level and logger, and in a child process of the server (``process`` names it:
    "core", "front 1") the time and that name. Logging that the caller set up already is
    left as it is."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler()
    if not verbose:
        handler.setFormatter(_Plain())
    elif process:
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s %(levelname)s [{process}] %(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger("asyncinfer").setLevel(logging.INFO)
