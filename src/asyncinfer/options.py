"""Command-line flags for engine options, generated from :class:`EngineConfig`'s fields.

Each option is declared once, as an ``EngineConfig`` field (see
:func:`asyncinfer.config.option`); ``serve``, ``generate`` and ``bench`` add the flags of
the options they take with :func:`add_engine_arguments`, and turn what the user gave back
into keyword options with :func:`engine_options`. A flag is ``--field-name`` (dashes for
underscores) unless the field names another spelling; its type comes from the field's
annotation, its help and choices from the field's metadata. A boolean option gets a pair,
``--x`` and ``--no-x``. Every flag defaults to None, so only the flags given are passed on
and the engine's own defaults apply to the rest (the help shows them).

Nothing here imports torch: ``asyncinfer --help`` builds these parsers.
"""

from __future__ import annotations

import argparse
import functools
import types
import typing
from collections.abc import Collection, Mapping
from typing import Any

import attrs

from asyncinfer.config import OPTION, EngineConfig, OptionInfo

__all__ = ["add_engine_arguments", "engine_option_names", "engine_options"]

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
