"""The ``asyncinfer serve`` subcommand's arguments (imports nothing heavy).

The server's own flags (address, key, limits and timeouts) are declared here; the engine's
are generated from ``EngineConfig`` (see :mod:`asyncinfer.options`).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from asyncinfer.errors import ConfigError
from asyncinfer.options import add_engine_arguments


def _serve(args: argparse.Namespace) -> int:
    from asyncinfer.server.main import serve

    return serve(args)


def check_serve_flags(args: argparse.Namespace) -> None:
    """The server's own flags: what no server can run with is a ConfigError naming it."""
    for name, value, least in (("--dp", args.dp, 1), ("--api-workers", args.api_workers, 1),
                               ("--max-waiting-requests", args.max_waiting_requests, 1),
                               ("--default-max-tokens", args.default_max_tokens, 1),
                               ("--max-tokens-limit", args.max_tokens_limit, 1)):
        if value is not None and value < least:
            raise ConfigError(f"{name} must be at least {least}, got {value}")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be a TCP port, 0 to 65535, got {args.port}")
    for name, seconds in (("--header-timeout", args.header_timeout),
                          ("--body-timeout", args.body_timeout)):
        if not seconds > 0:
            raise ConfigError(f"{name} must be more than 0 seconds, got {seconds:g}")
    for name, seconds in (("--shutdown-timeout", args.shutdown_timeout),
                          ("--shutdown-delay", args.shutdown_delay)):
        if not seconds >= 0:
            raise ConfigError(f"{name} must be 0 seconds or more, got {seconds:g}")


def _check_serve(args: argparse.Namespace) -> None:
    """What ``serve`` cannot run, refused before anything is fetched or loaded. The flags
    are checked here, in the process that stays an HTTP front, without torch; what needs
    torch (the device, the model's split) the engine core checks first thing, or, for
    ``--dp`` replicas, the launcher, which needs to know about every GPU they take."""
    from asyncinfer.machine import check_environment
    from asyncinfer.options import preflight

    check_serve_flags(args)
    config = preflight(args)
    if args.dp > 1:
        check_environment(config, replicas=args.dp)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``asyncinfer`` subcommands; returns its parser."""
    serve = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over HTTP: /v1/completions, /v1/chat/completions, "
                    "/v1/models, /generate, /health and /metrics.")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients send (default: the model's directory name)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("ASYNCINFER_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1/* and /generate "
                            "(default: $ASYNCINFER_API_KEY; unset: no key needed)")
    serve.add_argument("--api-workers", type=int, default=1,
                       help="HTTP front processes (parsing, tokenizing, detokenizing, "
                            "streaming), all on --port, beside the one engine core process")
    replicas = serve.add_argument_group("data-parallel replicas")
    replicas.add_argument("--dp", type=int, default=1,
                          help="run this many engine replicas (each with --tp ranks; on CUDA "
                               "replica i takes the GPUs from i*tp on) behind sglang-router "
                               "on --port (needs 'asyncinfer[router]')")
    replicas.add_argument("--router-policy", default="cache_aware",
                          choices=["cache_aware", "power_of_two", "round_robin", "random"],
                          help="with --dp: how the router picks a replica (cache_aware: "
                               "where the prompt's prefix is cached, unless loads differ much)")
    replicas.add_argument("--router-args", default="",
                          help="with --dp: more sglang-router flags, as one string "
                               "(e.g. \"--cache-threshold 0.5 --log-level warn\")")
    limits = serve.add_argument_group("limits and timeouts")
    limits.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="requests that may wait for the engine; past it a generation "
                             "request gets 503 with Retry-After")
    limits.add_argument("--default-max-tokens", type=int, default=1024,
                        help="output tokens of a chat request that sets no max_tokens")
    limits.add_argument("--max-tokens-limit", type=int, default=None,
                        help="the largest max_tokens a request may ask for (default: the "
                             "context length)")
    limits.add_argument("--header-timeout", type=float, default=30.0,
                        help="seconds a connection may take to send a request head, and may "
                             "stay idle between requests")
    limits.add_argument("--body-timeout", type=float, default=30.0,
                        help="seconds a request body may take to arrive (then 408)")
    limits.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM/SIGINT, seconds requests in flight may take to finish "
                             "before they are ended")
    limits.add_argument("--shutdown-delay", type=float, default=0.0,
                        help="on SIGTERM/SIGINT, seconds /health answers 503 while requests "
                             "are still served, before the drain: a router or load balancer "
                             "polling /health moves traffic away first (a rolling restart "
                             "loses nothing)")
    limits.add_argument("--special-tokens-in-text", action="store_true",
                        help="let prompt and chat text spell control tokens such as "
                             "<|im_end|> (off: such text is tokenized as plain text)")
    add_engine_arguments(serve, title="engine options")
    serve.set_defaults(func=_serve, check=_check_serve)
    return serve
