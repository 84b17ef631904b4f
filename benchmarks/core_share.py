"""How Linux shares core 0 between a busy process and a "server" that computes on both
cores, with and without a process beside that server that wakes every 50 microseconds on
core 0, the server in the busy process's session or in one of its own
(``python -m benchmarks.core_share``).

    python -m benchmarks.core_share --seconds 4 --json docs/benchmarks/core-share.json

Every process here spins or sleeps in pure Python, pinned to one core. The busy process
(core 0) stays in the driver's own session; the server side (a spinner on core 0, one on
core 1, and the waker when asked) runs under a leader started in the driver's session or in
a new one: Linux's autogroups put each session in a scheduling group of its own. The record has each
case's CPU seconds per second of the busy process and of the server's spinner on core 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from typing import Any

from benchmarks.cpu_serve import cpu_seconds, own_group
from benchmarks.util import git_commit, machine, process_tree, write_report

SPIN = "import os; os.sched_setaffinity(0, {%d})\nwhile True: pass"
WAKE = "import os, time; os.sched_setaffinity(0, {0})\nwhile True: time.sleep(0.00005)"
LEADER = ("import subprocess, sys\n"
          "children = [subprocess.Popen([sys.executable, '-c', code]) for code in sys.argv[1:]]\n"
          "children[0].wait()\n")


def autogroup(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            return f.read().split()[0]
    except OSError:
        return "unknown"


def one_case(own_session: bool, waker: bool, seconds: float) -> dict[str, Any]:
    """The busy process's and the server's core-0 spinner's CPU per second over
    ``seconds``."""
    busy = subprocess.Popen([sys.executable, "-c", SPIN % 0])
    codes = [SPIN % 0, SPIN % 1, *([WAKE] if waker else [])]
    leader = subprocess.Popen([sys.executable, "-c", LEADER, *codes], **own_group(own_session))
    try:
        while len(process_tree(leader.pid)) < len(codes):
            time.sleep(0.05)
        time.sleep(1.0)  # imports done, placement settled
        spinner = process_tree(leader.pid)[0]
        start, busy0, spin0 = time.monotonic(), cpu_seconds(busy.pid), cpu_seconds(spinner)
        time.sleep(seconds)
        wall = time.monotonic() - start
        return {"server_session": "own" if own_session else "shared", "waker": waker,
                "busy_core_share": (cpu_seconds(busy.pid) - busy0) / wall,
                "server_core_share": (cpu_seconds(spinner) - spin0) / wall,
                "seconds": wall, "busy_autogroup": autogroup(busy.pid),
                "server_autogroup": autogroup(spinner)}
    finally:
        for pid in [*process_tree(leader.pid), leader.pid, busy.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        leader.wait()
        busy.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--json", help="write the record here")
    args = parser.parse_args()
    cases = []
    started = time.time()
    for own_session in (False, True):
        for waker in (False, True):
            case = one_case(own_session, waker, args.seconds)
            print(f"server session {case['server_session']:6s} waker {waker!s:5s}  "
                  f"busy {case['busy_core_share']:.2f}  server {case['server_core_share']:.2f}"
                  " of the core", flush=True)
            cases.append(case)
    write_report(args.json, {
        "benchmark": "core_share",
        "command": [sys.executable, "-m", "benchmarks.core_share", *sys.argv[1:]],
        "commit": git_commit(), "machine": machine(),
        "date": time.strftime("%Y-%m-%d", time.gmtime(started)),
        "kernel": os.uname().release, "cases": cases})


if __name__ == "__main__":
    main()
