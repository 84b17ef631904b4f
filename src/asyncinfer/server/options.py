"""The options of one server, each declared once with its default, help and check.

``asyncinfer serve`` generates its server flags from these fields (see :mod:`.cli`).
"""



from __future__ import annotations

import argparse
from typing import Any

import attrs
from attrs import field, frozen

from asyncinfer.config import OPTION, OptionInfo
from asyncinfer.errors import ConfigError
from asyncinfer.server.reasoning import PARSERS
from asyncinfer.server.tool_parsers import PARSERS as TOOL_PARSERS

GROUP = "asyncinfer.server.group"
REPLICAS = "data-parallel replicas"
LIMITS = "limits and timeouts"
ROUTER_POLICIES = ("cache_aware", "power_of_two", "round_robin", "random")

Check = Any


def _option(default: Any, *, help: str, group: str | None = None, means: str | None = None,
            choices: tuple[str, ...] | None = None, check: Check = None) -> Any:
    info = OptionInfo(help=help, choices=choices, means=means)
    checks = [c for c in (check, _one_of(choices) if choices else None) if c is not None]
    return field(default=default, validator=checks or None,
                 metadata={OPTION: info, GROUP: group})


def _flag(attribute: attrs.Attribute[Any]) -> str:
    return "--" + attribute.name.replace("_", "-")


def _at_least(least: int) -> Check:
    def check(_: object, attribute: attrs.Attribute[Any], value: int | None) -> None:
        if value is not None and value < least:
            raise ConfigError(f"{_flag(attribute)} must be at least {least}, got {value}")
    return check


def _port(_: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if not 0 <= value <= 65535:
        raise ConfigError(f"{_flag(attribute)} must be a TCP port, 0 to 65535, got {value}")


def _above_zero(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{_flag(attribute)} must be more than 0 seconds, got {value:g}")


def _not_negative(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value >= 0:
        raise ConfigError(f"{_flag(attribute)} must be 0 seconds or more, got {value:g}")


def _one_of(values: tuple[str, ...]) -> Check:
    def check(_: object, attribute: attrs.Attribute[Any], value: str | None) -> None:
        if value is None and attribute.default is None:  # an option that may be off
            return
        if value not in values:
            raise ConfigError(f"{_flag(attribute)} must be one of {', '.join(values)}, "
                              f"got {value!r}")
    return check


@frozen
class ServerOptions:
    """Address, processes, limits and timeouts of one server; a wrong value is a ConfigError
    naming its flag."""

    served_model_name: str | None = _option(
        None, help="the model name clients send", means="the model's directory name")
    host: str = _option("127.0.0.1", help="the address to listen on")
    port: int = _option(8000, help="the TCP port to listen on", check=_port)
    api_key: str | None = _option(
        None, help="require 'Authorization: Bearer KEY' on /v1/* and /generate",
        means="$ASYNCINFER_API_KEY; unset: no key needed")
    api_workers: int = _option(
        1, check=_at_least(1),
        help="HTTP front processes (parsing, tokenizing, detokenizing, streaming), all on "
             "--port, beside the one engine core process")
    dp: int = _option(
        1, group=REPLICAS, check=_at_least(1),
        help="run this many engine replicas (each with --tp ranks; on CUDA replica i takes "
             "the GPUs from i*tp on) behind sglang-router on --port (needs "
             "'asyncinfer[router]')")
    router_policy: str = _option(
        "cache_aware", group=REPLICAS, choices=ROUTER_POLICIES,
        help="with --dp: how the router picks a replica (cache_aware: where the prompt's "
             "prefix is cached, unless loads differ much)")
    router_args: str = _option(
        "", group=REPLICAS, means="none",
        help="with --dp: more sglang-router flags, as one string "
             "(e.g. \"--cache-threshold 0.5 --log-level warn\")")
    max_waiting_requests: int = _option(
        1024, group=LIMITS, check=_at_least(1),
        help="requests that may wait for the engine; past it a generation request gets 503 "
             "with Retry-After")
    default_max_tokens: int = _option(
        1024, group=LIMITS, check=_at_least(1),
        help="output tokens of a chat request that sets no max_tokens")
    max_tokens_limit: int | None = _option(
        None, group=LIMITS, check=_at_least(1), means="the context length",
        help="the largest max_tokens a request may ask for")
    header_timeout: float = _option(
        30.0, group=LIMITS, check=_above_zero,
        help="seconds a connection may take to send a request head, and may stay idle "
             "between requests")
    body_timeout: float = _option(
        30.0, group=LIMITS, check=_above_zero,
        help="seconds a request body may take to arrive (then 408)")
    health_generate_timeout: float = _option(
        20.0, group=LIMITS, check=_above_zero,
        help="seconds GET /health_generate waits for its one generated token before it "
             "answers 503")
    shutdown_timeout: float = _option(
        30.0, group=LIMITS, check=_not_negative,
        help="on SIGTERM/SIGINT, seconds requests in flight may take to finish before they "
             "are ended")
    shutdown_delay: float = _option(
        0.0, group=LIMITS, check=_not_negative,
        help="on SIGTERM/SIGINT, seconds /health answers 503 while requests are still "
             "served, before the drain: a router or load balancer polling /health moves "
             "traffic away first (a rolling restart loses nothing)")
    special_tokens_in_text: bool = _option(
        False, group=LIMITS,
        help="let prompt and chat text spell control tokens such as <|im_end|> (off: such "
             "text is tokenized as plain text)")
    reasoning_parser: str | None = _option(
        None, choices=PARSERS, means="none",
        help="split a chat's output into message.reasoning_content (its <think> block) and "
             "content, streamed deltas too: qwen3 (a block the output opens) or deepseek_r1 "
             "(the output starts inside the block the template opened)")
    tool_call_parser: str | None = _option(
        None, choices=TOOL_PARSERS, means="none (tools may not be called)",
        help="read the tool calls of a chat's output as message.tool_calls, and let "
             "tool_choice auto, required or a named function call them: hermes "
             "(<tool_call> blocks: Qwen2.5, Qwen3, Hermes) or llama3_json (Llama 3.1 to 3.3 "
             "JSON calls)")
    retry_after: int = 1                # seconds, in the Retry-After of a 503

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerOptions:
        """The options the parsed flags in ``args`` give (checked)."""
        return cls(**{name: getattr(args, name) for name in option_names()
                      if hasattr(args, name)})


def option_names(group: str | object | None = ...) -> list[str]:
    """The server's option names, in declaration order (those of ``group`` if given)."""
    return [f.name for f in attrs.fields(ServerOptions) if OPTION in f.metadata
            and (group is ... or f.metadata[GROUP] == group)]


def option_defaults() -> dict[str, Any]:
    """Each option's declared default."""
    fields = attrs.fields_dict(ServerOptions)
    return {name: fields[name].default for name in option_names()}
