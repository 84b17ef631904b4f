"""The command line's help and reach: every flag of every subcommand has help that shows its
default, `generate` takes every engine option `serve` takes, and `asyncinfer models` lists
the cache without loading torch."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncinfer.cli import build_parser
from asyncinfer.options import engine_option_names


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
              ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _commands(child, (*path, name))


def _helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each argument's help as ``--help`` prints it, by its first flag (or its name)."""
    formatter: Any = parser._get_formatter()
    return {(action.option_strings or [action.dest])[0]: formatter._expand_help(action)
            for action in parser._actions
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))}


def _command(*path: str) -> argparse.ArgumentParser:
    return dict(_commands(build_parser()))[path]


def test_every_flag_of_every_subcommand_has_help_that_shows_its_default() -> None:
    missing = []
    for path, parser in _commands(build_parser()):
        for name, text in _helps(parser).items():
            flag = name.startswith("-")
            if not text.strip() or (flag and "default" not in text.lower()):
                missing.append(f"asyncinfer {' '.join(path)} {name}: {text!r}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("command, flag, default", [
    (("serve",), "--host", "127.0.0.1"), (("serve",), "--port", "8000"),
    (("generate",), "--max-tokens", "64"), (("generate",), "--temperature", "0.0"),
    (("generate",), "--top-k", "-1"), (("generate",), "--chat", "off"),
    (("generate",), "--max-running-requests", "1"), (("serve",), "--max-running-requests", "64"),
    (("bench", "serve"), "--num-requests", "64"),
])
def test_the_help_names_the_default_a_flag_has(command: tuple[str, ...], flag: str,
                                               default: str) -> None:
    text = _helps(_command(*command))[flag]
    assert f"(default: {default})" in text, text
    assert len(text) > len(f"(default: {default})")  # and says what it does


def test_generate_takes_every_engine_option_serve_takes() -> None:
    """One definition: the same engine flags, the policy and its options among them."""
    serve, generate = _command("serve"), _command("generate")
    names = set(engine_option_names())
    assert set(generate.get_default("engine_option_names")) == names
    assert set(serve.get_default("engine_option_names")) == names
    flags = {a.dest: a.option_strings for a in serve._actions if a.dest in names}
    assert {a.dest: a.option_strings for a in generate._actions if a.dest in names} == flags
    assert "--policy" in flags["policy"] and "--policy-opt" in flags["policy_options"]


def test_models_lists_the_cache_without_loading_torch(tmp_path: Any) -> None:
    """In a fresh interpreter: `asyncinfer models` prints the cache, each model with the
    architecture its config.json names, and torch is not in sys.modules after it."""
    code = ("import sys; from asyncinfer.cli import main; code = main(['models']); "
            "print('torch loaded' if 'torch' in sys.modules else 'no torch'); sys.exit(code)")
    model = tmp_path / "models" / "tiny-mistral"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"architectures": ["MistralForCausalLM"]}')
    env = {**os.environ, "ASYNCINFER_CACHE": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"cache: {tmp_path / 'models'}" in done.stdout
    assert f"tiny-mistral\tMistralForCausalLM\t0 MiB\t{model}" in done.stdout, done.stdout
    assert done.stdout.strip().splitlines()[-1] == "no torch", done.stdout


@pytest.mark.slow
def test_generate_runs_under_the_policy_and_options_it_is_given(
        smollm2_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`generate --policy decode_first --policy-opt max_decode_rounds=2` completes the
    prompt (greedy: the embedded model names Paris); an option the policy lacks is refused
    by name, exit status 2."""
    from asyncinfer.cli import main

    prompt = "The capital of France is"
    assert main(["generate", prompt, "--max-tokens", "4", "--policy", "decode_first",
                 "--policy-opt", "max_decode_rounds=2", "--seed", "3"]) == 0
    assert capsys.readouterr().out.startswith(f"{prompt} Paris")
    assert main(["generate", prompt, "--policy", "decode_first", "--policy-opt",
                 "aging=1"]) == 2
    assert "'aging'" in capsys.readouterr().err
