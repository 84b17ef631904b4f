"""Data parallelism: ``asyncinfer serve --dp 2``, two replicas behind sglang-router; chat
through the router, count what each replica served, stop with Ctrl-C.

    pip install 'asyncinfer[router]'
    python examples/serve_behind_router.py --router-policy round_robin --requests 6
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Sequence
from typing import Any

QUESTIONS = ["What is the capital of France?", "Name three prime numbers.",
             "What colour is the sky?", "Who wrote Hamlet?", "How many legs has a spider?",
             "What is 2 + 2?"]


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def post_json(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def served(replica: str) -> tuple[int, int]:
    """Requests and generated tokens a replica reports in its Prometheus ``/metrics``."""
    with urllib.request.urlopen(f"{replica}/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()

    def total(name: str) -> int:
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in lines
                       if line.startswith(name) and not line.startswith("#")))

    return total("asyncinfer_requests_total"), total("asyncinfer_generation_tokens_total")


def start(dp: int, port: int, serve_args: Sequence[str]
          ) -> tuple[subprocess.Popen[str], threading.Event]:
    """``asyncinfer serve --dp N`` once it serves; its output echoed until the returned
    event is set, then read and dropped."""
    cmd = [sys.executable, "-m", "asyncinfer.cli", "serve", "--dp", str(dp),
           "--port", str(port), *serve_args]
    print("$ asyncinfer " + " ".join(cmd[3:]), flush=True)
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    assert launcher.stdout is not None
    for line in launcher.stdout:
        print(f"  | {line}", end="", flush=True)
        if f"serving {dp} replicas" in line:
            break
    else:
        raise RuntimeError(f"asyncinfer serve exited with code {launcher.wait()}")
    quiet = threading.Event()

    def echo() -> None:  # keep reading: a full pipe would block the router
        for line in launcher.stdout or ():
            if not quiet.is_set():
                print(f"  | {line}", end="", flush=True)

    threading.Thread(target=echo, daemon=True).start()
    return launcher, quiet


def run(dp: int = 2, port: int = 8000, requests: int = 4, max_tokens: int = 16,
        serve_args: Sequence[str] = ()) -> dict[str, Any]:
    """Start ``dp`` replicas behind the router on ``port``, send ``requests`` chats, stop:
    the replicas, answers, each replica's counts and the exit code."""
    launcher, quiet = start(dp, port, serve_args)
    router = f"http://127.0.0.1:{port}"
    try:
        replicas = [w["url"] for w in get_json(f"{router}/workers")["workers"]]
        model = get_json(f"{router}/v1/models")["data"][0]["id"]
        print(f"router {router} -> replicas {replicas}, model {model}")
        answers = []
        for question in (QUESTIONS * requests)[:requests]:
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
                    "messages": [{"role": "user", "content": question}]}
            reply = post_json(f"{router}/v1/chat/completions", body)
            text = reply["choices"][0]["message"]["content"]
            answers.append((text, reply["usage"]["completion_tokens"]))
            print(f"> {question}\n  {text!r}")
        counts = {url: served(url) for url in replicas}
        for url, (n, tokens) in counts.items():
            print(f"replica {url}: {n} requests, {tokens} tokens generated")
    finally:
        quiet.set()
        launcher.send_signal(signal.SIGINT)  # Ctrl-C: replicas drain, then the router stops
        code = launcher.wait(timeout=120)
    print(f"asyncinfer serve exited with code {code}")
    return {"replicas": replicas, "answers": answers, "served": counts, "exit_code": code}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(  # no abbreviations: they would eat serve's flags
        description=__doc__.splitlines()[0], allow_abbrev=False,
        epilog="Other flags go to `asyncinfer serve`.")
    parser.add_argument("--dp", type=int, default=2, help="replicas (default: 2)")
    parser.add_argument("--port", type=int, default=8000,
                        help="the router's port (default: 8000; 0: a free one)")
    parser.add_argument("--requests", type=int, default=4, help="chat requests to send")
    parser.add_argument("--max-tokens", type=int, default=16)
    args, serve_args = parser.parse_known_args(argv)
    result = run(args.dp, args.port or free_port(), args.requests, args.max_tokens,
                 serve_args)
    return int(result["exit_code"])


if __name__ == "__main__":
    sys.exit(main())
