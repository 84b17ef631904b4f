"""A rate sweep of ``asyncinfer bench serve`` against ``asyncinfer serve``, one server per
policy, with the engine core's round counters and, optionally, py-spy profiles and the
offline figures to hold the served ones against (``python -m benchmarks.serve_sweep``)."""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.util import git_commit, write_report

# The --help epilog: how to run it.
USAGE = """\
For each policy it starts ``asyncinfer serve --policy P`` with the engine flags given after
``--``, waits for ``/health``, and for each rate runs ``asyncinfer bench serve`` (Poisson
arrivals, ``inf`` all at once), reading ``/metrics`` before and after: the engine core's
rounds, their host and device-wait seconds, and the running requests sampled every 0.25 s.
With ``--profile-rates R,..`` the core and every front are sampled by py-spy (``--profile-s`` s
at 200 Hz, idle included) during the runs at those rates, and the main thread's samples are
sorted into what they were doing. With ``--offline`` it first runs the GPU offline workload
(``benchmarks.offline --workload gpu``) and the decode step at ``--decode-batches`` (median
round of a decode batch of that many requests, offline), in the same machine and call.

    python -m benchmarks.serve_sweep --out OUT --shape qwen3-0.6b --tokenizer TOK \\
        --rates 40,100,inf --num-requests 400 --input-len-range 100,1024 \\
        --output-len-range 100,512 --slo-ttft-ms 500 --slo-tpot-ms 50 --offline \\
        --profile-rates 40,100 -- --device cuda --dtype bfloat16 --max-running-requests 256

On a CPU without ``--shape`` it serves the embedded model:
``python -m benchmarks.serve_sweep --out docs/benchmarks/serve --rates 0.5,1,2
--num-requests 12 --input-len 128 --output-len 32``.

The workload flags of ``asyncinfer bench serve`` (``--workload chat``, ``--arrival gamma``,
``--tenants``, ``--priorities``, ``--long-fraction`` ...; docs/workloads.md) pass through.
With ``--capacity-fractions 0.2,0.4,..`` the rates are fractions of a measured capacity, in
place of ``--rates``: the request throughput of the same workload sent all at once (rate
``inf``), measured with ``--capacity-policy`` (default prefill_first) before the others, or
with each policy for its own runs (``each``); the summary records it.

    python -m benchmarks.serve_sweep --out OUT --shape qwen3-0.6b --tokenizer TOK \\
        --policies prefill_first,priority,vtc --workload chat --tenants A:0.8,B:0.2 \\
        --capacity-fractions 0.2,0.4,0.6,0.8,1.0,1.2 --num-requests 1000 -- --device cuda
"""

POLICIES = ("prefill_first", "decode_first", "skip_ahead")
# Any registered policy runs; these are the ones compared (the last two are plugins).
KNOWN_POLICIES = (*POLICIES, "priority", "vtc", "shortest_prompt_first")

# `asyncinfer bench serve` flags passed through as given (it checks them).
WORKLOAD_FLAGS = ("input_len", "output_len", "input_len_range", "output_len_range",
                  "workload", "input_mean", "output_mean", "arrival", "burstiness", "tenants",
                  "tenant_rates", "priorities", "long_fraction", "long_factor",
                  "max_input_len", "slo_ttft_ms", "slo_tpot_ms", "service_w_in",
                  "service_w_out", "service_bucket_s", "seed")

# What a main-thread sample was doing: the first rule whose text is in the stack wins.
CATEGORIES = (
    ("launch: eager forward", ("ModelRunner._eager",)),
    ("launch: graph replay", ("ModelRunner._replay", "Graphs.run")),
    ("launch: other", ("ModelRunner.launch",)),
    ("schedule", ("Scheduler.schedule",)),
    ("process tokens", ("Scheduler.process",)),
    ("ipc out", ("EngineCore._flush", "EngineCore._report")),
    ("ipc in", ("EngineCore._receive", "EngineClient._read")),
    ("detokenize", ("Detokenizer", "detokeniz")),
    ("stream writes", ("StreamResponse.write", "_relay")),
    ("http parse and validate", ("_parse", "_json_body", "protocol.py")),
    ("tokenize", ("_Encoder", "tokenizer.py")),
    ("aiohttp", ("aiohttp/",)),
)


# A main-thread sample whose innermost Python frame is one of these is the loop waiting
# (uvloop's loop is C, so its caller is then the innermost frame).
IDLE = re.compile(r"(run_engine_core|serve|_front_process) \(asyncinfer/|"
                  r"(\S+\.)?(run_until_complete|run_forever|select|_run_once) ")


def shape_model(shape: str, tokenizer: Path, root: Path) -> Path:
    """A model directory of ``shape`` (config only: dummy weights) with ``tokenizer``'s files
    and vocabulary, so the server can tokenize."""
    from asyncinfer.bench.throughput import shape_dir

    model = shape_dir(shape, root)
    for item in tokenizer.iterdir():
        if item.is_file():
            shutil.copy(item, model / item.name)
    vocab = json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"]
    added = json.loads((tokenizer / "tokenizer.json").read_text()).get("added_tokens", [])
    size = max([*vocab.values(), *(t["id"] for t in added)]) + 1
    config = json.loads((model / "config.json").read_text())
    config["vocab_size"] = size
    (model / "config.json").write_text(json.dumps(config))
    return model


def metrics(url: str) -> dict[str, float]:
    """The samples of ``/metrics``, by name (labels included: ``name{label="value"}``)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    out = {}
    for line in text.splitlines():
        match = re.match(r"^(asyncinfer_[a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
        if match:
            out[match.group(1)] = float(match.group(2))
    return out


class Sampler(threading.Thread):
    """Samples the running requests every 0.25 s while the load runs."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.done = url, threading.Event()
        self.values: list[float] = []

    def run(self) -> None:
        while not self.done.wait(0.25):
            with contextlib.suppress(Exception):  # a failed scrape: one sample lost
                self.values.append(metrics(self.url)["asyncinfer_requests_running"])


def children(pid: int) -> list[int]:
    """The server's spawned processes (engine core first, then fronts 1..N-1)."""
    try:
        kids = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return [k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


def summarize_profile(path: Path) -> dict[str, Any]:
    """Main-thread samples of a py-spy raw profile, busy or idle, busy ones by category,
    and the busiest leaf functions."""
    cats: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    total = idle = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack.startswith("thread") or "MainThread" not in stack.split(";")[0]:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")[1:]
        leaf = frames[-1] if frames else ""
        if IDLE.match(leaf):
            idle += n
            continue
        cats[next((name for name, keys in CATEGORIES if any(k in stack for k in keys)),
                  "other")] += n
        leaves[leaf] += n
    busy = total - idle
    return {"samples": total, "busy": busy, "busy_share": round(busy / max(total, 1), 3),
            "busy_by_category": {k: round(v / max(busy, 1), 3) for k, v in cats.most_common()},
            "top_leaves": [[k, v] for k, v in leaves.most_common(12)]}


def profile(pids: dict[str, int], seconds: float, out: Path) -> list[subprocess.Popen[bytes]]:
    """Start py-spy on each process (it runs for ``seconds``)."""
    procs = []
    for name, pid in pids.items():
        procs.append(subprocess.Popen(
            ["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)),
             "--rate", "200", "--format", "raw", "--threads", "--idle", "--nonblocking",
             "--output", str(out / f"{name}.txt")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def add_workload_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Add ``WORKLOAD_FLAGS`` (but ``skip``) to ``parser``: strings, passed through."""
    for flag in WORKLOAD_FLAGS:
        if flag not in skip:
            parser.add_argument("--" + flag.replace("_", "-"), default=None,
                                help="passed to `asyncinfer bench serve`")


def workload_flags(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> list[str]:
    """The ``WORKLOAD_FLAGS`` set in ``args`` (but ``skip``), as command-line flags."""
    flags = []
    for flag in WORKLOAD_FLAGS:
        value = getattr(args, flag, None)
        if flag not in skip and value is not None:
            flags += ["--" + flag.replace("_", "-"), str(value)]
    return flags


def policy_flags(policy: str, options: list[str]) -> list[str]:
    """``--policy-opt`` flags of the server for ``policy``: each of ``options`` is
    ``[POLICY:]KEY=VALUE``, for that policy only when named, else for every policy."""
    flags = []
    for option in options:
        head, sep, rest = option.partition(":")
        if sep and "=" not in head:
            if head == policy:
                flags += ["--policy-opt", rest]
        else:
            flags += ["--policy-opt", option]
    return flags


def start_server(model: str | None, policy: str, port: int, engine_flags: list[str],
                 api_workers: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "asyncinfer.cli", "serve", "--port", str(port),
           "--policy", policy, "--api-workers", str(api_workers),
           "--max-waiting-requests", "100000", *engine_flags]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return proc
        except OSError:
            time.sleep(1.0)
    proc.kill()
    raise SystemExit(f"the server did not come up; see {log}")


@contextlib.contextmanager
def serving(model: str | None, policy: str, port: int, engine_flags: list[str],
            api_workers: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``start_server``, then SIGTERM on the way out (killed if it lingers 120 s)."""
    server = start_server(model, policy, port, engine_flags, api_workers, log)
    try:
        yield server
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def server_model(args: argparse.Namespace, engine_flags: list[str]
                 ) -> tuple[str | None, list[str]]:
    """The model directory to serve (--shape's, with dummy weights; None: the embedded
    model) and the engine flags that go with it."""
    if not args.shape:
        return None, engine_flags
    model = str(shape_model(args.shape, Path(args.tokenizer), Path(tempfile.mkdtemp())))
    return model, ["--load-format", "dummy", *engine_flags]


def run_rate(url: str, policy: str, rate: str, args: argparse.Namespace, out: Path,
             pids: dict[str, int] | None, name: str | None = None,
             load: list[str] | None = None) -> dict[str, Any]:
    """One `asyncinfer bench serve` run at ``rate`` (or the ``load`` flags given) with the
    workload flags of ``args``, into ``out/{name}.json`` (default ``{policy}-r{rate}``);
    its report, without the per-request rows, and the engine's counters over it."""
    before = metrics(url)
    sampler = Sampler(url)
    sampler.start()
    report = out / f"{name or f'{policy}-r{rate}'}.json"
    cmd = [sys.executable, "-m", "asyncinfer.cli", "bench", "serve", "--url", url,
           *(["--rate", rate] if load is None else load), "--num-requests", str(args.num_requests),
           "--policy", policy, "--json", str(report), "--timeout", "1800",
           *workload_flags(args)]
    spies = []
    if pids:
        spies = profile(pids, getattr(args, "profile_s", 8.0), out)
    start = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - start
    sampler.done.set()
    sampler.join()
    for spy in spies:
        spy.wait(timeout=120)
    after = metrics(url)

    def delta(name: str) -> float:
        return after.get(f"asyncinfer_{name}", 0.0) - before.get(f"asyncinfer_{name}", 0.0)

    rounds = delta("engine_rounds_total")
    result = json.loads(report.read_text())
    result.pop("requests", None)
    result["engine"] = {
        "rounds": int(rounds), "wall_s": round(wall, 2),
        "host_ms_per_round": round(1000 * delta("engine_round_host_seconds_total")
                                   / max(rounds, 1), 3),
        "wait_ms_per_round": round(1000 * delta("engine_round_wait_seconds_total")
                                   / max(rounds, 1), 3),
        "wait_share": round(delta("engine_round_wait_seconds_total") / wall, 3),
        # Busy: the batches' spans on the engine stream; the rest of the wall time, idle.
        "device_busy_share": round(delta("engine_device_busy_seconds_total") / wall, 3),
        "host_share": round(delta("engine_round_host_seconds_total") / wall, 3),
        "running_mean": round(statistics.fmean(sampler.values), 1) if sampler.values else 0,
        "batches_prefill": int(delta('batches_total{phase="prefill"}')),
    }
    if pids:
        result["profile"] = {name: summarize_profile(out / f"{name}.txt")
                             for name in pids if (out / f"{name}.txt").exists()}
    return result


def decode_steps(model: Path, batches: list[int], flags: list[str], prompt_len: int
                 ) -> dict[int, float]:
    """Median decode round (ms) of ``batch`` requests of ``prompt_len`` tokens, offline."""
    import gc

    import torch

    from asyncinfer.api import LLM
    from asyncinfer.cli import build_parser
    from asyncinfer.coordinator import Round
    from asyncinfer.options import engine_options
    from asyncinfer.params import SamplingParams

    options = engine_options(build_parser().parse_args(["serve", *flags]))
    options.pop("model", None)
    llm = LLM(str(model), skip_tokenizer_init=True, **options)
    out = {}
    params = SamplingParams(max_tokens=64, temperature=0.6, ignore_eos=True)
    for batch in batches:
        prompts = [[100 + (i * 7 + j) % 20000 for j in range(prompt_len)] for i in range(batch)]
        llm.generate(prompts[:8], params, use_tqdm=False)   # warm
        rounds: list[Round] = []
        llm.engine.observe_rounds(rounds.append)
        llm.generate(prompts, params, use_tqdm=False)
        llm.engine.observe_rounds(None)
        full = [r.host_s + r.wait_s for r in rounds if r.phase == "decode" and r.size == batch]
        out[batch] = round(1000 * statistics.median(full), 3) if full else float("nan")
    llm.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """The driver's own flags, and the engine flags after ``--``."""
    if "--" in argv:
        return argv[: argv.index("--")], argv[argv.index("--") + 1:]
    return argv, []


def add_server_flags(parser: argparse.ArgumentParser, port: int) -> None:
    """The flags of where results go and how each policy's server is started."""
    parser.add_argument("--out", required=True)
    parser.add_argument("--shape", help="serve a model of this shape with dummy weights")
    parser.add_argument("--tokenizer", help="the tokenizer files of --shape's model")
    parser.add_argument("--api-workers", type=int, default=1)
    parser.add_argument("--port", type=int, default=port,
                        help="the first policy's server listens here, the next one port+1 ...")
    parser.add_argument("--policy-opt", action="append", default=[],
                        metavar="[POLICY:]KEY=VALUE",
                        help="an option of the policy, passed to the server as --policy-opt "
                             "(repeatable); with POLICY: only to that policy's server")


def _fractions(text: str) -> list[float]:
    try:
        values = [float(f) for f in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0 < v < math.inf for v in values):
        raise argparse.ArgumentTypeError(f"expected fractions > 0 like 0.2,0.4,1.0, "
                                         f"got {text!r}")
    return values


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def main() -> int:
    argv, engine_flags = split_argv(sys.argv[1:])
    parser = argparse.ArgumentParser(description=__doc__, epilog=USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_flags(parser, port=18631)
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"comma-separated, any registered policy (default "
                             f"{','.join(POLICIES)}; also {','.join(KNOWN_POLICIES[3:])})")
    parser.add_argument("--rates", default="40,100,inf")
    parser.add_argument("--capacity-fractions", type=_fractions, default=None,
                        metavar="F,F,..",
                        help="in place of --rates: these fractions of the capacity (the "
                             "request throughput of the workload sent all at once)")
    parser.add_argument("--capacity-policy", default="prefill_first",
                        help="the policy that measures the capacity, or 'each' (every policy "
                             "its own) (default prefill_first)")
    parser.add_argument("--num-requests", type=int, default=400)
    add_workload_flags(parser)
    parser.add_argument("--profile-rates", default="",
                        help="profile the processes during these rates (comma-separated)")
    parser.add_argument("--profile-policies", default="decode_first,prefill_first")
    parser.add_argument("--profile-s", type=float, default=8.0)
    parser.add_argument("--offline", action="store_true",
                        help="first: the GPU offline workload and the decode steps")
    parser.add_argument("--decode-batches", default="64,128,192,256")
    args = parser.parse_args(argv)
    if args.tenant_rates and args.capacity_fractions:
        parser.error("--tenant-rates fixes the rates: leave out --capacity-fractions")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, engine_flags = server_model(args, engine_flags)
    summary: dict[str, Any] = {"benchmark": "serve-sweep", "commit": git_commit(),
                               "model": f"{args.shape} (dummy weights)" if args.shape
                               else "embedded", "engine_flags": engine_flags,
                               "api_workers": args.api_workers,
                               "command": "python -m benchmarks.serve_sweep " + " ".join(
                                   sys.argv[1:])}
    if args.offline:
        offline = out / "offline.json"
        assert model is not None, "--offline needs --shape"
        # nano-vllm's workload on the very model the servers serve.
        subprocess.run([sys.executable, "-m", "benchmarks.offline", "--workload", "gpu",
                        "--model", model, "--peers", "", "--json", str(offline),
                        *engine_flags], check=True)
        summary["offline_tokens_per_s"] = json.loads(offline.read_text())["tokens_per_s"]
        summary["offline_decode_step_ms"] = decode_steps(
            Path(model), [int(b) for b in args.decode_batches.split(",")], engine_flags, 560)
        write_report(str(out / "summary.json"), summary)
    policies = args.policies.split(",")
    measure_by = args.capacity_policy
    capacity: dict[str, float] = {}

    def server(policy: str, port: int) -> contextlib.AbstractContextManager[Any]:
        return serving(model, policy, port, [*engine_flags,
                                             *policy_flags(policy, args.policy_opt)],
                       args.api_workers, out / f"server-{policy}.log")

    def measure(url: str, policy: str) -> None:
        result = run_rate(url, policy, "inf", args, out, None, name=f"{policy}-capacity")
        capacity[policy] = result["request_throughput"]
        summary["capacity"] = {"measured_by": measure_by, "fractions": args.capacity_fractions,
                               "request_throughput": capacity}
        print(json.dumps({"policy": policy, "capacity_req_s": round(capacity[policy], 3)}),
              flush=True)

    if args.capacity_fractions and measure_by != "each":
        if measure_by in policies:  # measured on its own server, before the rest need it
            policies.remove(measure_by)
            policies.insert(0, measure_by)
        else:
            with server(measure_by, args.port + len(policies)):
                measure(f"http://127.0.0.1:{args.port + len(policies)}", measure_by)
    runs = []
    for i, policy in enumerate(policies):
        port = args.port + i
        url = f"http://127.0.0.1:{port}"
        with server(policy, port) as process:
            rates: list[tuple[str, float | None]] = [(r, None) for r in args.rates.split(",")]
            if args.tenant_rates:
                rates = [("mix", None)]  # the tenants' own rates, once
            elif args.capacity_fractions:
                by = policy if measure_by == "each" else measure_by
                if by not in capacity:
                    measure(url, policy)
                rates = [(f"{f * capacity[by]:.4g}", f) for f in args.capacity_fractions]
            for rate, fraction in rates:
                pids = None
                if (rate in args.profile_rates.split(",")
                        and policy in args.profile_policies.split(",")):
                    kids = children(process.pid)
                    pids = {"core": kids[0], "front0": process.pid}
                    pids.update({f"front{j}": k for j, k in enumerate(kids[1:], 1)})
                    pids = {f"{policy}-r{rate}-{k}": v for k, v in pids.items()}
                load: list[str] | None = [] if args.tenant_rates else None  # in the flags
                result = run_rate(url, policy, rate, args, out, pids, load=load)
                if fraction is not None:
                    result["capacity_fraction"] = fraction
                runs.append(result)
                print(json.dumps({"policy": policy, "rate": rate,
                                  "output_tok_s": round(result["output_throughput"], 1),
                                  "tpot_p50": _round(result["tpot_ms"]["p50"], 2),
                                  "ttft_p50": _round(result["ttft_ms"]["p50"], 1),
                                  **result["engine"]}), flush=True)
        summary["runs"] = runs
        write_report(str(out / "summary.json"), summary)
    reports = sorted(str(p) for p in out.glob("*-r*.json"))
    subprocess.run([sys.executable, "-m", "benchmarks.plot", str(out / "serve-sweep.png"),
                    *reports], check=False)  # TTFT and TPOT against rate (needs matplotlib)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
