"""Small helpers the benchmarks share."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any


def git_commit() -> str:
    """The short commit of the checkout the benchmark runs from ("unknown" outside git).

    ``ASYNCINFER_COMMIT`` wins: a copy of the tree on another machine can carry a stale
    ``.git``.
    """
    if os.environ.get("ASYNCINFER_COMMIT"):
        return os.environ["ASYNCINFER_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=False, cwd=Path(__file__).parent)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def checkout_commit(checkout: Path) -> str:
    """The short commit of another checkout ("unknown" outside git)."""
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def run_fresh(code: str, args: list[str], env: dict[str, str] | None = None,
              cwd: Path | None = None) -> Any:
    """Run ``code`` in a fresh Python process with ``args`` (and ``env`` over this process's
    environment): what its last line of output holds as JSON; its error output where it
    fails."""
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd)
    if done.returncode != 0:
        raise RuntimeError(f"a fresh run failed (exit {done.returncode}):\n"
                           f"{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_report(path: str | None, report: Any) -> None:
    """Write ``report`` as indented JSON to ``path`` (its folder made), if a path is given."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2) + "\n")


def machine() -> dict[str, Any]:
    """The CPU a record came from: its model name, the vector and matrix flags the kernels
    care about, and the usable cores (figures compare only on the same kind)."""
    name, flags = platform.processor() or "unknown", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name in ("unknown", platform.processor()):
                name = value.strip()
            if key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
    return {"cpu": name, "flags": [f for f in wanted if f in flags],
            "cores": len(os.sched_getaffinity(0))}

def rss(pid: int | str = "self") -> int:
    """Resident bytes of process ``pid`` (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def process_tree(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc)."""
    try:
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return children + [d for c in children for d in process_tree(c)]


def start_serve(*flags: str, timeout: float) -> tuple[subprocess.Popen[str], list[str]]:
    """An `asyncinfer serve` with ``flags`` on a free loopback port, once /health answers
    200 (its stderr a pipe), and its command; RuntimeError if it exits first or does not
    answer within ``timeout`` seconds (then it is killed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "asyncinfer.cli", "serve", "--port", str(port), *flags]
    server = subprocess.Popen(command, env=os.environ.copy(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while True:
        if server.poll() is not None:
            err = server.stderr.read() if server.stderr else ""
            raise RuntimeError(f"the server exited: {err[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health",
                                        timeout=2) as response:
                if response.status == 200:
                    return server, command
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop(server)
            raise RuntimeError(f"the server did not come up in {timeout:g} s")
        time.sleep(0.5)


def stop(server: subprocess.Popen[str]) -> None:
    """SIGTERM, then SIGKILL if the server lingers 60 s."""
    server.terminate()
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
