"""Resident memory of an idle `asyncinfer serve` on CPU, the front and every process below it.

For each setting of ``--cpu-fp32-compute`` asked for (``auto``: this CPU's native kernels
where it has them; ``on``: float32 kernels, as a CPU without bf16 units runs), start the
server on the embedded model with its defaults, wait for /health 200, let it settle, and
sum VmRSS over the process tree. The record keeps each process's figure.

    python -m benchmarks.idle_memory --json docs/benchmarks/cpu-idle-memory.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.util import (
    git_commit,
    machine,
    process_tree,
    rss,
    start_serve,
    stop,
    write_report,
)


def _name(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]


def measure(fp32_compute: str, settle_s: float) -> dict[str, Any]:
    """One server's idle resident memory, by process."""
    server, command = start_serve("--device", "cpu", "--cpu-fp32-compute", fp32_compute,
                                  timeout=600)
    try:
        time.sleep(settle_s)
        pids = [server.pid, *process_tree(server.pid)]
        processes: list[dict[str, Any]] = [
            {"pid": p, "command": _name(p), "rss_bytes": rss(p)} for p in pids]
    finally:
        stop(server)
    total = sum(int(p["rss_bytes"]) for p in processes)
    return {"cpu_fp32_compute": fp32_compute, "command": " ".join(command[1:]),
            "total_gb": round(total / 1e9, 3), "processes": processes}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.idle_memory",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default="auto,on",
                        help="values of --cpu-fp32-compute to measure, comma-separated")
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds to wait after /health answers 200")
    parser.add_argument("--json", default=None, help="where to write the record")
    args = parser.parse_args(argv)
    runs = [measure(s, args.settle) for s in args.settings.split(",")]
    for run in runs:
        print(f"--cpu-fp32-compute {run['cpu_fp32_compute']}: {run['total_gb']:.2f} GB "
              f"over {len(run['processes'])} processes")
    write_report(args.json, {
        "benchmark": "idle_memory", "command": " ".join(["python", "-m",
                                                         "benchmarks.idle_memory", *sys.argv[1:]]),
        "commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "machine": machine(),
        "memory_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1),
        "runs": runs})


if __name__ == "__main__":
    main()
