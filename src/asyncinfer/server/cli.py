"""``asyncinfer serve``: its flags, its checks, and the dispatch to one server or replicas.

Imports nothing heavy: the server modules load when the command runs.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from asyncinfer.options import add_engine_arguments, add_option_arguments
from asyncinfer.server.options import (
    LIMITS,
    REPLICAS,
    ServerOptions,
    option_defaults,
    option_names,
)


def serve(args: argparse.Namespace) -> int:
    """Serve as the flags say: ``--dp`` replicas behind a router, or one server."""
    if ServerOptions.from_args(args).dp > 1:
        from asyncinfer.server.replicas import serve_replicas

        return serve_replicas(args)
    from asyncinfer.server.main import serve as serve_one

    return serve_one(args)


def _check_serve(args: argparse.Namespace) -> None:
    """Refuse what ``serve`` cannot run before anything loads, without torch here (the core
    checks the device; with ``--dp``, this process checks every replica's GPUs)."""
    from asyncinfer.options import preflight

    options = ServerOptions.from_args(args)
    config = preflight(args)
    if options.dp > 1:
        from asyncinfer.machine import check_environment

        check_environment(config, replicas=options.dp)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``asyncinfer`` subcommands; returns its parser."""
    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over HTTP: /v1/completions, /v1/chat/completions, "
                    "/v1/models, /generate, /health and /metrics.")
    defaults = {**option_defaults(), "api_key": os.environ.get("ASYNCINFER_API_KEY")}
    for title in (None, REPLICAS, LIMITS):
        add_option_arguments(parser, ServerOptions, option_names(title), title=title,
                             defaults=defaults)
    add_engine_arguments(parser, title="engine options")
    parser.set_defaults(func=serve, check=_check_serve)
    return parser
