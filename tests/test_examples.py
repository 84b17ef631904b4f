"""The examples run and show what they claim, on the tiny test models: the scheduling
trace, streaming from AsyncEngine, the openai client against a server, the policy plugin
built and installed apart from this environment, and two replicas behind sglang-router."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

# Engine options that keep the tiny models' engines small.
TINY = ["--dtype", "float32", "--kv-cache-gb", "0.05"]


def test_scheduling_trace_matches_the_chapter(smollm2_dir: Path) -> None:
    from scheduling_trace import run_trace

    rounds, same = run_trace(verbose=False)
    assert [(phase, size) for phase, size, _ in rounds] == [
        ("prefill", 5), ("decode", 4), ("decode", 3), ("decode", 3), ("decode", 2),
        ("decode", 1)]
    assert all(same)


def test_stream_async_engine_streams_one_and_interleaves_many(
        tiny_chat_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from stream_async_engine import PROMPTS, main, run

    (deltas, single), (arrivals, outputs) = asyncio.run(
        run(8, model=str(tiny_chat_llama_dir), dtype="float32", kv_cache_gb=0.05))
    # The text came in pieces, and the pieces are the output's text.
    assert len(deltas) > 1 and "".join(deltas) == single.text
    assert len(single.token_ids) == 8 and single.finish_reason == "length"
    assert [out.prompt for out in outputs] == PROMPTS
    assert all(len(out.token_ids) == 8 for out in outputs)
    # Streamed together, the requests' deltas came interleaved: another request's first
    # delta before the first request's last ...
    last_of_first = len(arrivals) - 1 - arrivals[::-1].index(0)
    assert min(arrivals.index(1), arrivals.index(2)) < last_of_first
    # ... and sharing batches changed no greedy token.
    assert outputs[0].token_ids == single.token_ids
    capsys.readouterr()
    assert main(["--model", str(tiny_chat_llama_dir), "--max-tokens", "2", *TINY]) == 0
    printed = capsys.readouterr().out
    assert "one stream:" in printed and "3 concurrent streams" in printed
    assert printed.count("(2 tokens, length)") == 3


@pytest.fixture
def server(tiny_chat_llama_dir: Path) -> Iterator[str]:
    """An `asyncinfer serve` of the tiny chat model (it has SmolLM2's chat template)."""
    from tests.test_server_process import start_server

    proc, url = start_server(tiny_chat_llama_dir)
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0


def test_openai_chat_whole_and_streamed(server: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("openai")
    from openai_chat import main, run

    whole, streamed = run(f"{server}/v1", None, "What is the capital of France?",
                          max_tokens=8)
    # Greedy: the streamed answer is the whole one, arriving in several chunks.
    assert whole.text and streamed.text == whole.text
    assert whole.completion_tokens == streamed.completion_tokens
    assert whole.completion_tokens is not None and 0 < whole.completion_tokens <= 8
    assert whole.finish_reason == streamed.finish_reason
    assert streamed.chunks > 1
    capsys.readouterr()
    assert main(["--base-url", f"{server}/v1", "--max-tokens", "3", "Hello"]) == 0
    printed = capsys.readouterr().out
    assert "model SmolLM2-135M-Instruct" in printed  # found by listing the server's models
    assert "whole:" in printed and "streamed:" in printed


# The example policy plugin: the policy on hand-built views, then the package built and
# installed into a directory of its own (never into this environment), found through its
# entry point by a process that has that directory on its path.

PLUGIN = EXAMPLES / "policy_plugin"


def _plugin_module() -> ModuleType:
    """The plugin's module, loaded from its file (no entry point involved)."""
    path = PLUGIN / "src" / "asyncinfer_example_policy" / "__init__.py"
    spec = importlib.util.spec_from_file_location("asyncinfer_example_policy", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_policy_decides_by_output_budget_with_aging() -> None:
    from asyncinfer.errors import ConfigError
    from asyncinfer.policies import Decision, Policy, SchedulerView, WaitingRequest

    policy_class = _plugin_module().ShortestOutputFirst

    def view(*waiting: tuple[int, int, int]) -> SchedulerView:  # (uid, max_tokens, waited)
        return SchedulerView(
            waiting=tuple(WaitingRequest(uid=u, prompt_len=10, prefill_remaining=10,
                                         remaining_tokens=m, arrival_round=50 - w,
                                         waited_rounds=w, chunked=False)
                          for u, m, w in waiting),
            running=(), free_pages=64, free_slots=4, token_budget=512, page_size=16,
            round=50, decode_streak=0)

    policy = policy_class()
    assert isinstance(policy, Policy) and policy.name == "shortest_output_first"
    assert policy.decide(view((0, 12, 0), (1, 2, 0), (2, 8, 0), (3, 2, 0))) == (
        Decision.prefill([1, 3, 2, 0], "stop"))  # fewest first; ties in arrival order
    # Aging: 12 tokens after 11 rounds' wait rank 1, before a new request's 2.
    assert policy.decide(view((0, 12, 11), (1, 2, 0))).candidates == (0, 1)
    assert policy_class(aging=0).decide(view((0, 12, 11), (1, 2, 0))).candidates == (1, 0)
    assert policy.decide(view()) == Decision.decode()
    for bad in (-1, float("nan"), True, "fast"):
        with pytest.raises(ConfigError, match="shortest_output_first: option aging"):
            policy_class(aging=bad)


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The plugin built from a copy of its folder (the build writes beside its sources)
    and installed with pip into a directory of its own; that directory."""
    source = tmp_path_factory.mktemp("plugin-source") / "policy_plugin"
    shutil.copytree(PLUGIN, source,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp_path_factory.mktemp("plugin-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--no-index", "--target", str(target),
                    str(source)], check=True, timeout=300)
    assert (target / "asyncinfer_example_policy" / "__init__.py").exists()
    return str(target)


def _with_plugin(plugin_path: str, *args: str) -> str:
    """Run ``python ARGS`` with the plugin's directory on the path; its stdout."""
    paths = [plugin_path, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_installed_plugin_is_listed_by_asyncinfer_policies(plugin_path: str) -> None:
    from asyncinfer.policies.registry import available_policies

    listed = _with_plugin(plugin_path, "-m", "asyncinfer.cli", "policies")
    assert "shortest_output_first  (asyncinfer_example_policy:ShortestOutputFirst)" in listed
    assert "aging=1.0" in listed
    assert "prefill_first" in listed  # beside the built-ins
    # This environment never had it installed.
    assert "shortest_output_first" not in available_policies()


def test_installed_plugin_orders_admission_in_an_engine(plugin_path: str,
                                                        tiny_chat_llama_dir: Path) -> None:
    """demo.py runs five requests through a one-slot engine under each policy (it checks
    the engine's policy by name and every output's length) and prints the order."""
    printed = _with_plugin(plugin_path, str(PLUGIN / "demo.py"),
                           "--model", str(tiny_chat_llama_dir), *TINY)
    orders = dict(re.findall(r"^(\w+) +admitted \(max_tokens\): (\[.*\])$", printed,
                             re.MULTILINE))
    assert orders == {"prefill_first": "[12, 2, 8, 1, 5]",
                      "shortest_output_first": "[1, 2, 5, 8, 12]"}


def test_serve_behind_router_answers_through_two_replicas(tiny_chat_llama_dir: Path) -> None:
    pytest.importorskip("sglang_router")
    from serve_behind_router import free_port, run

    result = run(dp=2, port=free_port(), requests=4, max_tokens=4, serve_args=[
        "--model", str(tiny_chat_llama_dir), "--dtype", "float32", "--kv-cache-gb", "0.25",
        "--max-running-requests", "4", "--router-policy", "round_robin",
        "--shutdown-delay", "1"])
    assert result["exit_code"] == 0, "Ctrl-C stops the replicas and the router cleanly"
    assert len(result["replicas"]) == 2
    answers = result["answers"]
    assert len(answers) == 4 and all(text and 0 < tokens <= 4 for text, tokens in answers)
    # Round robin: each replica served two of the requests, and their tokens add up.
    served = result["served"].values()
    assert sorted(requests for requests, _ in served) == [2, 2]
    assert sum(tokens for _, tokens in served) == sum(tokens for _, tokens in answers)
