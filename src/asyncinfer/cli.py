"""The `asyncinfer` command: serve | generate | models | policies | bench."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from asyncinfer.errors import AsyncInferError
from asyncinfer.logs import configure_logging
from asyncinfer.options import add_engine_arguments, engine_options, in_flag_terms
from asyncinfer.threads import set_compute_environment

# `generate` runs one request: one request slot is enough, unless --max-running-requests says.
GENERATE_DEFAULTS = {"max_running_requests": 1}
ENGINE_OPTIONS = "engine options"


def _generate(args: argparse.Namespace) -> int:
    from asyncinfer.api import LLM
    from asyncinfer.params import SamplingParams

    # No seed of its own: the engine's (--seed) seeds a request that sets none.
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, stop=args.stop)
    llm = LLM(**{**GENERATE_DEFAULTS, **engine_options(args)})
    assert llm.tokenizer is not None
    if args.chat:
        prompt: str | list[int] = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}])
    else:
        prompt = args.prompt
    [out] = llm.generate([prompt], params, use_tqdm=False)
    if out.error:
        print(f"asyncinfer: error: {out.error}", file=sys.stderr)
        return 2
    print(out.text if args.chat else args.prompt + out.text)
    return 0


def _check_generate(args: argparse.Namespace) -> None:
    """What ``generate`` cannot run, refused before the model is fetched or loaded."""
    from asyncinfer.machine import check_environment
    from asyncinfer.options import preflight

    check_environment(preflight(args, GENERATE_DEFAULTS))


def _models(args: argparse.Namespace) -> int:
    from asyncinfer.models.source import EMBEDDED_NAME, cached_models, models_dir

    found = cached_models()
    print(f"cache: {models_dir()}")
    if not found:
        print(f"(empty: the embedded {EMBEDDED_NAME} is fetched on first use)")
    for path in found:
        size = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20
        print(f"{path.name}\t{_architecture(path)}\t{size:.0f} MiB\t{path}")
    return 0


def _architecture(path: Path) -> str:
    """The architecture config.json names (what the engine picks a family by)."""
    import json

    try:
        names = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return "(unreadable config.json)"
    return ",".join(str(n) for n in names) or "(no architecture named)"


def _policies(args: argparse.Namespace) -> int:
    from asyncinfer.policies.registry import describe_policies

    print(describe_policies())
    return 0


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends every flag's text with its default, where the text does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.default is argparse.SUPPRESS
                or "default" in text.lower()):
            return text
        return f"{text} (default: {_shown(action.default)})".replace("%", "%%") if text else (
            f"(default: {_shown(action.default)})")


def _shown(default: object) -> str:
    if default is None:
        return "none"
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, (list, tuple)):
        return " ".join(map(str, default)) or "none"
    return str(default)


class Parser(argparse.ArgumentParser):
    """A parser that takes no abbreviated flag (``--max-token`` is not ``--max-tokens-limit``),
    answers an unknown one with its subcommand's usage and the closest flag it has, and
    shows every flag's default; its subcommands' parsers are of the same class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            parser = self._chosen(parsed)
            flags = [flag for action in parser._actions for flag in action.option_strings]
            close = difflib.get_close_matches(extra[0].partition("=")[0], flags, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
        return parsed

    def _chosen(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The deepest subcommand's parser that ``parsed`` went through."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                child = action.choices.get(getattr(parsed, action.dest, None) or "")
                if isinstance(child, Parser):
                    return child._chosen(parsed)
        return self


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = Parser(prog="asyncinfer", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log every library's INFO lines, with their level and logger "
                             "(by default: asyncinfer's start-up steps and progress, and "
                             "warnings)")
    sub = parser.add_subparsers(dest="command", required=True)

    from asyncinfer.server.cli import add_serve_parser

    add_serve_parser(sub)

    gen = sub.add_parser("generate", help="complete one prompt and print the result")
    gen.add_argument("prompt", help="the text to complete (with --chat: the user's message)")
    gen.add_argument("--max-tokens", type=int, default=64, help="output tokens at most")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature (0: greedy)")
    gen.add_argument("--top-p", type=float, default=1.0,
                     help="sample from the smallest set of tokens whose probability reaches "
                          "this (1: all)")
    gen.add_argument("--top-k", type=int, default=-1,
                     help="sample from the k most likely tokens (-1: all)")
    gen.add_argument("--stop", action="append", default=None,
                     help="stop when the output spells this string (repeatable)")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt in the model's chat template as a user message")
    # The engine options are serve's, every one (--seed seeds the one request's sampling).
    add_engine_arguments(gen, title=ENGINE_OPTIONS,
                         defaults_here={k: str(v) for k, v in GENERATE_DEFAULTS.items()})
    gen.set_defaults(func=_generate, check=_check_generate)

    models = sub.add_parser("models", help="list the models in the cache")
    models.set_defaults(func=_models)

    policies = sub.add_parser("policies", help="list the installed scheduling policies")
    policies.set_defaults(func=_policies)

    bench = sub.add_parser("bench", help="tokens/s offline, or load a running server (the "
                                         "comparisons with peers live in the repository's "
                                         "benchmarks/)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from asyncinfer.bench.serve import add_parser as add_bench_serve_parser
    from asyncinfer.bench.throughput import add_parser as add_bench_offline_parser

    add_bench_offline_parser(bench_sub)
    add_bench_serve_parser(bench_sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script.

    A subcommand's ``check`` (where it has one) runs first: what cannot work with the
    flags given, or on this machine, is refused before anything is fetched or loaded. An
    error asyncinfer raises on purpose is one line on stderr, the options it names spelled
    as flags, and exit status 2 (argparse's for a usage error)."""
    set_compute_environment()  # before torch loads OpenMP here or in the processes started
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    try:
        check = getattr(args, "check", None)
        if check is not None:
            check(args)
        return int(args.func(args))
    except AsyncInferError as exc:
        message = " ".join(in_flag_terms(str(exc)).split())  # one line, whatever it holds
        print(f"asyncinfer: error: {message}", file=sys.stderr)
        return 2


def console() -> NoReturn:
    """The console script: ``main``, then exit without the interpreter's teardown, which
    takes a second or more once torch is loaded; everything is closed and flushed by then."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    console()
