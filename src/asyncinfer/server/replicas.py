"""``asyncinfer serve --dp N``: N whole servers on this host behind sglang-router.

See docs/architecture.md, "Data-parallel replicas".
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import multiprocessing
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from asyncinfer.errors import AsyncInferError, ConfigError, EngineError
from asyncinfer.processes import describe_exit, die_with_parent

logger = logging.getLogger(__name__)

START_TIMEOUT = 1800.0          # seconds a replica may take to load and answer /health
ROUTER_START_TIMEOUT = 120.0    # seconds the router may take to list every replica
HEALTH_INTERVAL = 1             # the router's /health polling, seconds
HEALTH_FAILURES = 2             # failed polls before the router takes a replica out


def serve_replicas(args: argparse.Namespace) -> int:
    """Run ``args.dp`` replicas and the router until SIGTERM or SIGINT (then 0), or until
    one of them dies (then 1)."""
    count = args.dp
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        raise ConfigError("--dp needs sglang-router: pip install 'asyncinfer[router]'"
                          ) from None
    tp = args.tensor_parallel_size or 1
    from asyncinfer.server.main import listen

    listen(args.host, args.port).close()  # the router's port is free: fail now, not later
    ports = [_free_port() for _ in range(count)]
    spawn = multiprocessing.get_context("spawn")
    replicas = [spawn.Process(target=_replica_main, name=f"asyncinfer-replica-{i}",
                              args=(_replica_args(args, i, tp, port),))
                for i, port in enumerate(ports)]
    router: subprocess.Popen[bytes] | None = None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    failure = ""
    try:
        for replica in replicas:
            replica.start()
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for replica, url in zip(replicas, urls):
            _wait_healthy(replica, url, stop)
        if stop.is_set():
            return 0
        router = _start_router(args, urls)
        _wait_router(router, args, count, stop)
        logger.info("%s", banner(args, urls, [_server_info(url) for url in urls]))
        while not stop.wait(0.2):
            failure = _first_exit(replicas, router)
            if failure:
                logger.error("%s; stopping every replica and the router", failure)
                break
    finally:
        for replica in replicas:  # they go unready, drain and exit, together
            if replica.is_alive() and replica.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(replica.pid, signal.SIGTERM)
        wait = args.shutdown_delay + args.shutdown_timeout + 30
        for replica in replicas:
            replica.join(wait)
            if replica.is_alive():
                replica.kill()
                replica.join()
        if router is not None:
            router.terminate()
            try:
                router.wait(10)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait()
    return 1 if failure else 0


def _replica_args(args: argparse.Namespace, index: int, tp: int,
                  port: int) -> argparse.Namespace:
    """Replica ``index``'s own serve arguments: one replica, a local port, its GPUs."""
    own = copy.copy(args)
    own.dp, own.host, own.port, own.replica = 1, "127.0.0.1", port, index
    if getattr(args, "kv_events", None) is not None:  # each its own publisher, its rank
        from asyncinfer.engine.kv_publisher import KVEventsSettings

        own.kv_events = KVEventsSettings.parse(args.kv_events).for_replica(index).to_json()
    if args.shutdown_delay == 0.0:  # the router must see /health fail before the drain
        own.shutdown_delay = HEALTH_INTERVAL * (HEALTH_FAILURES + 1)
    device = args.device or "cpu"
    if device.startswith("cuda"):
        base = int(device.partition(":")[2] or 0)
        own.device = f"cuda:{base + index * tp}"
    return own


def _replica_main(args: argparse.Namespace) -> None:
    """A replica's process: ``asyncinfer serve`` for one replica, ended with its parent."""
    from asyncinfer.logs import configure_logging
    from asyncinfer.server.main import serve

    die_with_parent(signal.SIGTERM)
    configure_logging(bool(getattr(args, "verbose", False)), f"replica :{args.port}")
    try:
        code = serve(args)
    except AsyncInferError as exc:  # one line; the launcher says which replica stopped
        logger.error("replica %d: %s", args.replica, exc)
        code = 2
    raise SystemExit(code)


def banner(args: argparse.Namespace, urls: list[str], infos: list[dict[str, Any]]) -> str:
    """What the launcher says once the router lists every replica: the router's URL and
    policy, the model and how it runs, and each replica's URL, device and KV cache (from
    its /server_info)."""
    from asyncinfer.server.main import http_url

    url = http_url(args.host, args.port)
    first = infos[0] if infos else {}
    name = first.get("served_model_name") or "?"
    lines = [f"serving {len(urls)} replicas of {name} behind sglang-router "
             f"({args.router_policy}) on {url} (Ctrl-C to stop)",
             f"  model     {name}, from {first.get('model_path')}",
             f"  dtype     {first.get('dtype')}",
             f"  policy    {first.get('policy')}",
             f"  parallel  tp {first.get('tp_size', 1)}, dp {len(urls)}"]
    for index, (replica, info) in enumerate(zip(urls, infos)):
        pages, page = info.get("kv_pages_total", 0), info.get("page_size") or 16
        lines.append(f"  replica {index} {replica}: {info.get('device')}, KV cache {pages} "
                     f"pages of {page} tokens = {pages * page} tokens")
    lines.append(f"  API       {url}/v1 (OpenAI, through the router), {url}/workers")
    return "\n".join(lines)


def _server_info(url: str) -> dict[str, Any]:
    """A replica's /server_info (empty if it cannot be read)."""
    import json

    try:
        with urllib.request.urlopen(f"{url}/server_info", timeout=5) as response:
            info = json.loads(response.read())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _router_command(args: argparse.Namespace, urls: list[str]) -> list[str]:
    return [sys.executable, "-m", "sglang_router.launch_router",
            "--worker-urls", *urls, "--policy", args.router_policy,
            "--host", args.host, "--port", str(args.port),
            "--prometheus-port", str(_free_port()),
            "--health-check-interval-secs", str(HEALTH_INTERVAL),
            "--health-failure-threshold", str(HEALTH_FAILURES),
            "--log-level", "warn",  # a line per request otherwise; health changes are warnings
            *shlex.split(args.router_args or "")]


def _start_router(args: argparse.Namespace, urls: list[str]) -> subprocess.Popen[bytes]:
    """The router, in a session of its own (a terminal's Ctrl-C reaches this process,
    which stops the replicas first), ended with this process."""
    return subprocess.Popen(_router_command(args, urls), start_new_session=True,
                            preexec_fn=lambda: die_with_parent(signal.SIGTERM))


def _wait_healthy(replica: Any, url: str, stop: threading.Event) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not stop.is_set():
        if replica.exitcode is not None:
            raise EngineError(f"replica {replica.name} {describe_exit(replica.exitcode)} "
                              "while starting")
        if _get(f"{url}/health") == 200:
            return
        if time.monotonic() > deadline:
            raise EngineError(f"replica {replica.name} did not start within "
                              f"{START_TIMEOUT:g} s")
        time.sleep(0.2)


def _wait_router(router: subprocess.Popen[bytes], args: argparse.Namespace, count: int,
                 stop: threading.Event) -> None:
    """Wait until the router lists every replica as healthy."""
    import json

    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    url = f"http://{host}:{args.port}/workers"
    deadline = time.monotonic() + ROUTER_START_TIMEOUT
    while not stop.is_set():
        if router.poll() is not None:
            raise EngineError(f"sglang-router exited with code {router.returncode} while "
                              "starting")
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(url, timeout=2) as response:
                workers = json.loads(response.read()).get("workers", [])
            if sum(bool(w.get("is_healthy")) for w in workers) >= count:
                return
        if time.monotonic() > deadline:
            raise EngineError(f"sglang-router did not list {count} healthy replicas within "
                              f"{ROUTER_START_TIMEOUT:g} s")
        time.sleep(0.2)


def _first_exit(replicas: list[Any], router: subprocess.Popen[bytes]) -> str:
    for replica in replicas:
        if replica.exitcode is not None:
            return f"replica {replica.name} {describe_exit(replica.exitcode)}"
    if router.poll() is not None:
        return f"sglang-router {describe_exit(router.returncode)}"
    return ""


def _get(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
