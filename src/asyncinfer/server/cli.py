"""The ``asyncinfer serve`` subcommand's arguments (imports nothing heavy)."""

from __future__ import annotations

import argparse
import os
from typing import Any


def _serve(args: argparse.Namespace) -> int:
    from asyncinfer.server.main import serve

    return serve(args)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``asyncinfer`` subcommands; returns its parser."""
    serve = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over HTTP: /v1/completions, /v1/chat/completions, "
                    "/v1/models, /generate, /health and /metrics.")
    serve.add_argument("--model", default=None,
                       help="local model directory, .gguf file or hub id "
                            "(default: the embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients send (default: the model's directory name)")
    serve.add_argument("--policy", default="prefill_first",
                       help="scheduling policy (see `asyncinfer policies`)")
    serve.add_argument("--policy-opt", action="append", default=[], metavar="KEY=VALUE",
                       help="a policy option (repeatable), e.g. --policy-opt aging=0.5")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("ASYNCINFER_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1/* and /generate "
                            "(default: $ASYNCINFER_API_KEY; unset: no key needed)")
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
    limits.add_argument("--special-tokens-in-text", action="store_true",
                        help="let prompt and chat text spell control tokens such as "
                             "<|im_end|> (off: such text is tokenized as plain text)")
    engine = serve.add_argument_group("engine options (defaults: the engine's)")
    engine.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    engine.add_argument("--device", default=None, help="cpu or cuda[:N]")
    engine.add_argument("--page-size", type=int, default=None, help="tokens per KV page")
    engine.add_argument("--max-running-requests", type=int, default=None)
    engine.add_argument("--max-extend-tokens", type=int, default=None,
                        help="prefill tokens one round may compute")
    engine.add_argument("--cache-type", choices=["radix", "naive"], default=None)
    engine.add_argument("--no-chunked-prefill", action="store_true",
                        help="refuse prompts longer than --max-extend-tokens")
    engine.add_argument("--kv-cache-gb", type=float, default=None)
    engine.add_argument("--max-seq-len", type=int, default=None,
                        help="longest prompt + output")
    engine.add_argument("--load-format", choices=["auto", "dummy"], default=None)
    engine.add_argument("--attention-backend", choices=["auto", "torch", "flashinfer"],
                        default=None, help="auto: flashinfer on CUDA when installed")
    engine.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="share of GPU memory the engine may hold (default 0.9); the KV "
                             "cache takes what weights and activations leave")
    engine.add_argument("--no-cuda-graph", action="store_true",
                        help="run decode eagerly instead of replaying CUDA graphs")
    engine.add_argument("--cuda-graph-max-bs", type=int, default=None,
                        help="largest decode batch captured (default: the running limit)")
    engine.add_argument("--no-torch-compile", action="store_true",
                        help="run norms, rotary, SiLU and sampling as separate eager kernels "
                             "instead of torch.compile's fused ones (CUDA, half precision)")
    engine.add_argument("--no-overlap", action="store_true",
                        help="do not schedule the next batch while one runs")
    serve.set_defaults(func=_serve)
    return serve
