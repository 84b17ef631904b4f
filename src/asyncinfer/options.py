"""Command-line flags generated from option declarations (``EngineConfig``, ``ServerOptions``).

A flag is ``--field-name`` (or the field's spelling), typed by its annotation, with the help
and choices of its :class:`~asyncinfer.config.OptionInfo`. Imports no torch.
"""

from __future__ import annotations

import argparse
import functools
import re
import types
import typing
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import attrs

from asyncinfer.config import OPTION, EngineConfig, OptionInfo
from asyncinfer.errors import ConfigError

__all__ = ["add_engine_arguments", "add_option_arguments", "engine_option_names",
           "engine_options", "flag", "in_flag_terms", "preflight"]

# The namespace attribute that lists the engine options a parser declared.
_DECLARED = "engine_option_names"


def engine_option_names() -> tuple[str, ...]:
    """Every engine option, in declaration order."""
    return tuple(a.name for a in attrs.fields(EngineConfig))


def add_engine_arguments(parser: argparse.ArgumentParser, *,
                         only: Collection[str] | None = None, exclude: Collection[str] = (),
                         title: str | None = None,
                         defaults_here: Mapping[str, str] | None = None) -> None:
    """Add a flag for each engine option (``only`` if given, less ``exclude``);
    ``defaults_here``: this command's own defaults, as the help shows them."""
    names = [n for n in (only if only is not None else engine_option_names())
             if n not in exclude]
    unknown = sorted(set(names) - set(engine_option_names()))
    if unknown:
        raise ValueError(f"not engine options: {', '.join(unknown)}")
    add_option_arguments(parser, EngineConfig, names, title=title, shown=defaults_here)
    parser.set_defaults(**{_DECLARED: tuple(names)})


def add_option_arguments(parser: argparse.ArgumentParser, owner: type, names: Iterable[str],
                         *, title: str | None = None, shown: Mapping[str, str] | None = None,
                         defaults: Mapping[str, Any] | None = None) -> None:
    """Add a flag for each named ``option()`` field of the attrs class ``owner``; it
    defaults to None unless ``defaults`` gives it a value (``shown``: the help's default)."""
    group: Any = parser.add_argument_group(title) if title else parser
    fields = attrs.fields_dict(owner)
    for name in names:
        flags, kwargs = _flag(owner, fields[name], _types(owner)[name],
                              (shown or {}).get(name))
        if defaults and name in defaults:
            kwargs["default"] = defaults[name]
        group.add_argument(*flags, **kwargs)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineConfig`` keyword options of the flags given in ``args`` (``KEY=VALUE``
    flags as a mapping; ConfigError if malformed)."""
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
        raise TypeError(f"{field.name} is not declared with option()")
    return info


@functools.cache
def _types(owner: type) -> dict[str, Any]:
    """Each field's annotation, evaluated (the modules' annotations are strings)."""
    return typing.get_type_hints(owner)


def _flag(owner: type, field: attrs.Attribute[Any], annotation: Any,
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
        raise TypeError(f"{owner.__name__}.{field.name}: no flag for a {annotation!r}")
    if info.choices is not None:
        kwargs["choices"] = info.choices
    return [flag], kwargs


def _bare(annotation: Any) -> Any:
    """The type a flag parses: ``int | None`` → int, a Literal or a mapping → str."""
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
    """``message`` with the engine options it names spelled as flags ("cuda_graph=False" →
    "--no-cuda-graph"); a one-word name counts only given a value or before "must"."""
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
    from asyncinfer.policies.registry import check_policy

    try:
        check_policy(config.policy, config.policy_options)
    except ConfigError as exc:
        raise ConfigError(f"{flag('policy')} {config.policy}: {exc}") from None


