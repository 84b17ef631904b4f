"""Served against offline on the same requests: one workload file through ``LLM.generate``
and through `asyncinfer bench serve --workload-file` against `asyncinfer serve`, in one call.

The workload (nano-vllm's on ``--workload gpu``: 256 prompts of 100..1,024 ids, outputs of
100..1,024 tokens, temperature 0.6; the CPU offline workload's 64 on ``cpu``, greedy) is
written to a file once; both sides read it, serve the same model directory with the same
engine flags (those after ``--``) and ignore EOS, so both generate the same number of
tokens. Each side first warms its engine with a full prefill round of other prompts, then
runs the workload once, all of it at once (offline: one ``generate``; served: every request
sent at t=0). Rounds alternate the order (offline first in even rounds). The record holds
every run, the ratio per round and the median ratio (``served_over_offline_same_requests``).

    python -m benchmarks.served_vs_offline --workload gpu --shape qwen3-0.6b \\
        --tokenizer TOK --rounds 2 --out OUT -- --device cuda --dtype bfloat16

On a CPU it serves the embedded model (``--workload cpu``, no ``--shape``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from asyncinfer.bench.throughput import machine, offline_workload
from asyncinfer.bench.workload_file import read_workload_file, write_workload_file
from benchmarks.gpu_offline import warm_up_prompts
from benchmarks.offline import in_child
from benchmarks.serve_sweep import server_model, serving, split_argv
from benchmarks.util import git_commit, write_report

# Each workload's engine defaults (as benchmarks.offline uses), before the flags after --.
DEFAULTS = {"gpu": ["--device", "cuda", "--max-running-requests", "256", "--max-seq-len",
                    "2048", "--max-extend-tokens", "16384"],
            "cpu": ["--max-running-requests", "64", "--max-seq-len", "2048"]}
TEMPERATURE = {"gpu": 0.6, "cpu": 0.0}


def engine_options(flags: list[str]) -> dict[str, Any]:
    """The engine options ``flags`` set, as `asyncinfer serve` reads them."""
    from asyncinfer.options import add_engine_arguments
    from asyncinfer.options import engine_options as options_of

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return options_of(parser.parse_args(flags))


def run_offline(model: str, flags: list[str], workload: str, warm_up: str) -> dict[str, Any]:
    """In a fresh process: the engine, its warm-up, then one ``generate`` over the file."""
    from asyncinfer.api import LLM
    from asyncinfer.params import SamplingParams

    def params(path: str) -> tuple[list[list[int]], list[SamplingParams]]:
        specs = read_workload_file(path)
        return [list(s.prompt) for s in specs], [
            SamplingParams(max_tokens=s.output_len, temperature=s.temperature, top_p=s.top_p,
                           seed=s.seed, ignore_eos=True) for s in specs]

    options = engine_options(flags)
    start = time.perf_counter()
    llm = LLM(model, skip_tokenizer_init=True, **options)
    startup = time.perf_counter() - start
    try:
        llm.generate(*params(warm_up), use_tqdm=False)
        prompts, sampling = params(workload)
        start = time.perf_counter()
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        llm.close()
    errors = [o.error for o in outputs if o.error is not None]
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"side": "offline", "requests": len(outputs), "failed": len(errors),
            "output_tokens": tokens, "seconds": round(seconds, 3),
            "output_tokens_per_s": round(tokens / seconds, 1),
            "startup_s": round(startup, 1), "policy": llm.policy.name}


def bench_serve(url: str, workload: Path, report: Path) -> dict[str, Any]:
    """`asyncinfer bench serve` with the workload file, every request at once."""
    subprocess.run([sys.executable, "-m", "asyncinfer.cli", "bench", "serve", "--url", url,
                    "--workload-file", str(workload), "--rate", "inf", "--timeout", "3600",
                    "--json", str(report)], check=True)
    return json.loads(report.read_text())


def run_served(model: str, policy: str, flags: list[str], workload: Path, warm_up: Path,
               out: Path, port: int, api_workers: int, tag: str) -> dict[str, Any]:
    """A server with the flags, warmed by the warm-up file, then the workload file."""
    start = time.perf_counter()
    with serving(model, policy, port, flags, api_workers, out / f"server-{tag}.log"):
        startup = time.perf_counter() - start
        url = f"http://127.0.0.1:{port}"
        bench_serve(url, warm_up, out / f"warm-up-{tag}.json")
        report = bench_serve(url, workload, out / f"served-{tag}.json")
    return {"side": "served", "requests": report["completed"] + report["failed"],
            "failed": report["failed"], "output_tokens": report["total_output_tokens"],
            "seconds": round(report["duration_s"], 3),
            "output_tokens_per_s": round(report["output_throughput"], 1),
            "startup_s": round(startup, 1), "report": f"served-{tag}.json",
            "tpot_ms_p50": report["tpot_ms"]["p50"], "ttft_ms_p50": report["ttft_ms"]["p50"]}


def main() -> int:
    argv, user_flags = split_argv(sys.argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the record and the runs' reports go here")
    parser.add_argument("--shape", help="serve a model of this shape with dummy weights")
    parser.add_argument("--tokenizer", help="the tokenizer files of --shape's model")
    parser.add_argument("--api-workers", type=int, default=1)
    parser.add_argument("--port", type=int, default=18731)
    parser.add_argument("--workload", choices=sorted(DEFAULTS), default="gpu")
    parser.add_argument("--rounds", type=_positive, default=1,
                        help="offline then served in even rounds, served then offline in odd")
    parser.add_argument("--requests", type=_positive, default=None,
                        help="only the workload's first this many requests")
    parser.add_argument("--warm-up-tokens", type=int, default=None,
                        help="prompt tokens of the warm-up round (default: max_extend_tokens)")
    args = parser.parse_args(argv)
    if args.shape and not args.tokenizer:
        parser.error("--shape needs --tokenizer: the server tokenizes")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, flags = server_model(args, [*DEFAULTS[args.workload], *user_flags])
    if model is None:  # the embedded model, on both sides
        from asyncinfer.models.source import embedded_model_dir

        model = str(embedded_model_dir())
    from asyncinfer.config import EngineConfig

    config = EngineConfig(**engine_options(flags))  # checked before any engine starts
    prompts, max_tokens = offline_workload(args.workload)
    prompts, max_tokens = prompts[: args.requests], max_tokens[: args.requests]
    temperature = TEMPERATURE[args.workload]
    workload = write_workload_file(out / "workload.json", prompts, max_tokens, temperature)
    extend = args.warm_up_tokens or config.max_extend_tokens
    warm = warm_up_prompts(extend, length=min(512, extend))
    warm_up = write_workload_file(out / "warm-up.json", warm, [8] * len(warm), temperature)
    runs: list[dict[str, Any]] = []
    ratios = []
    for round_ in range(args.rounds):
        sides = ["offline", "served"] if round_ % 2 == 0 else ["served", "offline"]
        this: dict[str, dict[str, Any]] = {}
        for side in sides:
            if side == "offline":
                run = in_child(run_offline, model, flags, str(workload), str(warm_up))
            else:
                run = run_served(model, config.policy, flags, workload, warm_up, out, args.port,
                                 args.api_workers, f"r{round_}")
            run["round"] = round_
            this[side] = run
            runs.append(run)
            print(json.dumps(run), flush=True)
        _check_same_work(this, sum(max_tokens))
        ratio = this["served"]["output_tokens_per_s"] / this["offline"]["output_tokens_per_s"]
        ratios.append(round(ratio, 3))
        print(f"round {round_}: served {this['served']['output_tokens_per_s']:,.0f} tok/s, "
              f"offline {this['offline']['output_tokens_per_s']:,.0f} tok/s: "
              f"{ratio:.3f}", flush=True)
    report = {
        "benchmark": "served_vs_offline",
        "command": "python -m benchmarks.served_vs_offline " + " ".join(sys.argv[1:]),
        "commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "machine": _machine(),
        "model": f"{args.shape} (dummy weights)" if args.shape else Path(model).name,
        "workload": args.workload, "requests": len(prompts), "temperature": temperature,
        "input_tokens": sum(map(len, prompts)), "output_tokens": sum(max_tokens),
        "engine_flags": flags, "api_workers": args.api_workers, "rounds": args.rounds,
        "served_over_offline_by_round": ratios,
        "served_over_offline_same_requests": statistics.median(ratios), "runs": runs}
    write_report(str(out / "served-vs-offline.json"), report)
    print(f"served / offline on the same requests: {report['served_over_offline_same_requests']}"
          f" (median of {args.rounds} rounds: {ratios})")
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def _check_same_work(sides: dict[str, dict[str, Any]], tokens: int) -> None:
    """A ratio compares the same work only: every request done, every token made."""
    for side, run in sides.items():
        if run["failed"] or run["output_tokens"] != tokens:
            raise SystemExit(f"{side}: {run['failed']} requests failed, "
                             f"{run['output_tokens']} of {tokens} tokens: no ratio")


def _machine() -> dict[str, Any]:
    """The CPU, and the GPU where the engine ran on one."""
    found = machine()
    try:
        import torch

        if torch.cuda.is_available():
            found["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return found


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
