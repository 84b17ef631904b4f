"""Policies by name from the ``asyncinfer.policies`` entry points: a factory called with
the user's options (its TypeError or ValueError becomes a ConfigError)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from asyncinfer.errors import ConfigError
from asyncinfer.policies.base import Policy

GROUP = "asyncinfer.policies"


def available_policies() -> dict[str, EntryPoint]:
    """The installed policies, name → entry point, sorted by name."""
    found: dict[str, EntryPoint] = {}
    for ep in sorted(entry_points(group=GROUP), key=lambda ep: (ep.name, ep.value)):
        found.setdefault(ep.name, ep)
    return found


def load_policy(policy: str | Policy, options: Mapping[str, Any] | None = None) -> Policy:
    """A policy by registered name, built with ``options``; an instance passes through."""
    options = dict(options or {})
    if not isinstance(policy, str):
        if options:
            raise ConfigError(f"policy options {sorted(options)} were given with a policy "
                              f"instance ({policy!r}); pass them to its constructor instead")
        return _checked(policy, repr(policy))
    factory = check_policy(policy, options)
    try:
        instance = factory(**options)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"policy {policy!r}: bad options {options}: {exc}") from exc
    return _checked(instance, repr(policy))


def check_policy(name: str, options: Mapping[str, Any] | None = None) -> Any:
    """The factory registered as ``name``, its option names checked; nothing is built (the
    values are the factory's to judge)."""
    factory = _factory(name)
    known = getattr(factory, "options", None)
    if isinstance(known, Mapping):
        for key in sorted(options or {}):
            if key not in known:
                raise ConfigError(f"policy {name!r} has no option {key!r}; its options: "
                                  f"{', '.join(known) or '(none)'}")
    return factory


def _factory(name: str) -> Any:
    matches = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not matches:
        raise ConfigError(f"unknown policy {name!r}; installed policies: "
                          f"{', '.join(available_policies()) or '(none)'}")
    targets = sorted({ep.value for ep in matches})
    if len(targets) > 1:
        raise ConfigError(f"policy {name!r} is registered more than once "
                          f"({', '.join(targets)}); uninstall all but one")
    try:
        return matches[0].load()
    except Exception as exc:  # a broken plugin must not look like an engine crash
        raise ConfigError(f"policy {name!r} ({targets[0]}) failed to load: "
                          f"{type(exc).__name__}: {exc}") from exc


def _checked(policy: Any, label: str) -> Policy:
    if not isinstance(policy, Policy) or not isinstance(policy.name, str):
        raise ConfigError(f"policy {label} is not a Policy: it needs a `name` string and a "
                          f"`decide(view) -> Decision` method, got {policy!r}")
    return policy


def parse_policy_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``["aging=0.5", "verbose=true"]`` → ``{"aging": 0.5, "verbose": True}``."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ConfigError(f"malformed policy option {pair!r}; expected key=value, "
                              f"as in --policy-opt aging=0.5")
        if key in options:
            raise ConfigError(f"policy option {key!r} is given twice")
        options[key] = _parse_value(text.strip())
    return options


def _parse_value(text: str) -> Any:
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def describe_policies() -> str:
    """What ``asyncinfer policies`` prints: each name, its summary and its options."""
    blocks: list[str] = []
    for name, ep in available_policies().items():
        try:
            factory = ep.load()
        except Exception as exc:  # list the others even if one plugin is broken
            blocks.append(f"{name}  ({ep.value})\n    failed to load: {exc}")
            continue
        doc = inspect.getdoc(factory) or "(no description)"
        lines = [f"{name}  ({ep.value})", f"    {doc.splitlines()[0]}"]
        described: Mapping[str, str] = getattr(factory, "options", None) or {}
        defaults = _defaults(factory)
        heads = {option: f"{option}={defaults[option]!r}" if option in defaults else option
                 for option in described or defaults}
        if heads:
            lines.append("    options (--policy-opt key=value):")
            width = max(map(len, heads.values()))
            lines += [f"      {head:<{width}}  {described.get(option, '')}".rstrip()
                      for option, head in heads.items()]
        else:
            lines.append("    no options")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n" if blocks else "no policies installed\n"


def _defaults(factory: Any) -> dict[str, Any]:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in params
            if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD
            if p.default is not p.empty}
