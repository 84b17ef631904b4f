"""asyncinfer behind sglang-router: `serve --dp 2` answers through the router exactly as a
replica does directly, the cache-aware policy keeps shared prefixes on one replica's cache,
and a rolling restart under load loses no request. CPU, a small random Llama with SmolLM2's
tokenizer (fast to load twice)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncinfer.server.replicas import HEALTH_FAILURES, HEALTH_INTERVAL
from tests.test_server_process import _free_port, descendants, none_left, start_server

pytest.importorskip("sglang_router")

NAME = "SmolLM2-135M-Instruct"  # start_server's --served-model-name


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def wait_for(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, ValueError):
            value = check()
            if value:
                return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def healthy_workers(router: str) -> list[str]:
    return [w["url"] for w in get_json(f"{router}/workers")["workers"] if w["is_healthy"]]


@pytest.fixture(scope="module")
def replicas(tiny_chat_llama_dir: Path) -> Iterator[tuple[str, list[str]]]:
    """`asyncinfer serve --dp 2` (router on its port); the router's URL and the replicas'."""
    port = _free_port()
    cmd = [sys.executable, "-m", "asyncinfer.cli", "serve", "--dp", "2", "--port", str(port),
           "--model", str(tiny_chat_llama_dir), "--served-model-name", NAME,
           "--dtype", "float32", "--max-running-requests", "8", "--kv-cache-gb", "0.25"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    router = f"http://127.0.0.1:{port}"
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # up once it says so
            if "serving 2 replicas" in line:
                break
        assert proc.poll() is None, "the launcher exited while starting"
        workers = healthy_workers(router)
        assert len(workers) == 2
        children = descendants(proc.pid)
        yield router, workers
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        code = proc.wait(timeout=90)
    assert code == 0, "Ctrl-C stops the replicas and the router cleanly"
    assert none_left(children, timeout=15), "and leaves no process"


def test_the_router_knows_the_served_model(replicas: tuple[str, list[str]]) -> None:
    router, workers = replicas
    assert [m["id"] for m in get_json(f"{router}/v1/models")["data"]] == [NAME]
    info = get_json(f"{workers[0]}/server_info")
    assert (info["served_model_name"], info["tp_size"], info["dp_size"], info["policy"]) == (
        NAME, 1, 1, "prefill_first")
    model = get_json(f"{workers[0]}/model_info")
    assert model["is_generation"] is True and model["architectures"] == ["LlamaForCausalLM"]
    [load] = get_json(f"{workers[0]}/get_load")  # one data-parallel rank
    assert (load["num_reqs"], load["num_tokens"]) == (0, 0)


def test_answers_through_the_router_equal_a_replicas(replicas: tuple[str, list[str]]) -> None:
    """The openai client's greedy chat and completion, through the router and straight to
    each replica: the same text."""
    openai = pytest.importorskip("openai")
    router, workers = replicas

    def answers(base: str) -> tuple[str, str]:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12, temperature=0.0).choices[0].message.content
        text = client.completions.create(model=NAME, prompt="def fibonacci(n):",
                                         max_tokens=12, temperature=0.0).choices[0].text
        return chat or "", text

    through = answers(router)
    assert all(through) and through == answers(workers[0]) == answers(workers[1])


def shared_prefix_prompts(groups: int = 4, each: int = 5) -> list[tuple[int, str]]:
    """``groups`` long prefixes, ``each`` requests per prefix with their own question."""
    subjects = ["rivers of Europe", "prime numbers", "the history of tea", "sailing ships"]
    prompts = []
    for g in range(groups):
        prefix = (f"Document {g}: a long briefing about {subjects[g]}. "
                  + " ".join(f"Fact {i} about {subjects[g]} is recorded in chapter {i}."
                             for i in range(40)))
        prompts += [(g, f"{prefix}\nQuestion {q}: summarize fact {q * 7}.") for q in range(each)]
    return prompts


def cache_affinity(router: str, prompts: list[tuple[int, str]], tokenizer: Any,
                   page: int = 16) -> tuple[int, int]:
    """Send ``prompts`` one by one through the router: the prompt tokens served from
    cache, and the shareable ones (every request's shared prefix, whole pages, but the
    first of its group)."""
    first_seen: set[int] = set()
    cached = shareable = 0
    body = {"model": NAME, "max_tokens": 2, "temperature": 0.0}
    for group, prompt in prompts:
        request = urllib.request.Request(f"{router}/v1/completions", method="POST",
                                         data=json.dumps({**body, "prompt": prompt}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            usage = json.loads(response.read())["usage"]
        cached += usage["prompt_tokens_details"]["cached_tokens"]
        if group in first_seen:
            prefix = prompt.split("\nQuestion")[0]
            shareable += len(tokenizer.encode(prefix)) // page * page
        first_seen.add(group)
    return cached, shareable


def test_cache_aware_routing_serves_shared_prefixes_from_cache(
        replicas: tuple[str, list[str]], tiny_chat_llama_dir: Path) -> None:
    """20 requests over 4 long shared prefixes, interleaved: at least 80% of the shareable
    prefix tokens come from a replica's prefix cache (random routing: docs/benchmarks.md)."""
    from asyncinfer.tokenizer import Tokenizer

    router, _ = replicas
    prompts = shared_prefix_prompts()
    interleaved = [prompts[g * 5 + q] for q in range(5) for g in range(4)]
    cached, shareable = cache_affinity(router, interleaved,
                                       Tokenizer.from_pretrained(tiny_chat_llama_dir))
    assert shareable > 0
    assert cached >= 0.8 * shareable, (cached, shareable)


def prefix_counters(worker: str) -> tuple[float, float]:
    """A replica's prompt tokens looked up in its prefix cache, and found there."""
    with urllib.request.urlopen(f"{worker}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    return (float(values["asyncinfer_prefix_cache_query_tokens_total"]),
            float(values["asyncinfer_prefix_cache_hit_tokens_total"]))


def flush(worker: str) -> None:
    request = urllib.request.Request(f"{worker}/flush_cache", method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        assert json.loads(response.read())["held_pages"] == 0


def test_cache_aware_routing_hits_the_prefix_cache_more_than_round_robin(
        replicas: tuple[str, list[str]], tiny_chat_llama_dir: Path, tmp_path: Path) -> None:
    """The same 15 requests over 3 shared prefixes, interleaved, through the cache-aware
    router and through a round-robin one over the same replicas, each from empty caches
    (POST /flush_cache): the replicas' prefix-cache hit rate, from their /metrics, is higher
    behind the cache-aware one; every request succeeds."""
    from asyncinfer.tokenizer import Tokenizer

    router, workers = replicas
    prompts = shared_prefix_prompts(groups=3)
    interleaved = [prompts[g * 5 + q] for q in range(5) for g in range(3)]
    tokenizer = Tokenizer.from_pretrained(tiny_chat_llama_dir)
    port = _free_port()
    with open(tmp_path / "round-robin.log", "wb") as log:
        round_robin = _router(workers, port, log, policy="round_robin")
    rates = {}
    try:
        rr_url = f"http://127.0.0.1:{port}"
        wait_for(lambda: len(healthy_workers(rr_url)) == 2, 60, "two healthy workers")
        for name, url in (("cache_aware", router), ("round_robin", rr_url)):
            for worker in workers:
                flush(worker)
            before = [prefix_counters(w) for w in workers]
            cache_affinity(url, interleaved, tokenizer)   # raises on a failed request
            after = [prefix_counters(w) for w in workers]
            queried = sum(a[0] - b[0] for a, b in zip(after, before))
            hit = sum(a[1] - b[1] for a, b in zip(after, before))
            rates[name] = hit / queried
    finally:
        round_robin.send_signal(signal.SIGINT)
        round_robin.wait(timeout=30)
    assert rates["cache_aware"] > rates["round_robin"], rates


def _router(urls: list[str], port: int, log: Any,
            policy: str = "cache_aware") -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls,
         "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
         "--prometheus-port", str(_free_port()),
         "--health-check-interval-secs", str(HEALTH_INTERVAL),
         "--health-failure-threshold", str(HEALTH_FAILURES), "--log-level", "warn"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


async def test_a_rolling_restart_under_load_fails_no_request(tiny_chat_llama_dir: Path,
                                                             tmp_path: Path) -> None:
    """Two `asyncinfer serve` replicas behind the router, 200 requests at a steady rate;
    one replica gets SIGTERM mid-run and comes back on its port. Every request succeeds,
    the router's log shows it took the replica out, and the other served meanwhile."""
    import aiohttp

    delay = ("--shutdown-delay", str(HEALTH_INTERVAL * (HEALTH_FAILURES + 1)))
    model = tiny_chat_llama_dir
    first, first_url = start_server(model, *delay)
    second, second_url = start_server(model, *delay)
    port = _free_port()
    log_path = tmp_path / "router.log"
    with open(log_path, "wb") as log:
        router = _router([first_url, second_url], port, log)
    url = f"http://127.0.0.1:{port}"
    restarted: subprocess.Popen[str] | None = None
    try:
        await asyncio.get_running_loop().run_in_executor(
            None, wait_for, lambda: len(healthy_workers(url)) == 2, 60, "two healthy workers")
        results: list[int] = []

        async def one(session: aiohttp.ClientSession, i: int) -> None:
            body = {"model": NAME, "prompt": f"Request {i}: count to ten.", "max_tokens": 8,
                    "temperature": 0.0, "ignore_eos": True}
            async with session.post(f"{url}/v1/completions", json=body) as response:
                await response.read()
                results.append(response.status)

        async with aiohttp.ClientSession() as session:
            tasks = []
            for i in range(200):
                tasks.append(asyncio.ensure_future(one(session, i)))
                if i == 40:  # mid-run: the first replica is restarted
                    first.send_signal(signal.SIGTERM)
                if i == 40 + 1 and restarted is None:
                    restart = asyncio.get_running_loop().run_in_executor(
                        None, _restart, first, model, first_url, delay)
                await asyncio.sleep(0.08)
            restarted = await restart
            await asyncio.gather(*tasks)
        assert results.count(200) == 200, sorted(set(results))
        log_text = log_path.read_text(errors="replace")
        assert f"{first_url}/health" in log_text, "the router saw the replica go"
        assert "deprecated" not in log_text, "registration used the current worker routes"
        second_served = get_json_metric(second_url, "asyncinfer_requests_total")
        assert second_served > 0
        await asyncio.get_running_loop().run_in_executor(
            None, wait_for, lambda: len(healthy_workers(url)) == 2, 30, "the replica's return")
    finally:
        for proc in (router, second, restarted, first):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(60)
                if proc.poll() is None:
                    proc.kill()


def _restart(old: subprocess.Popen[str], model: Path, url: str,
             extra: tuple[str, ...]) -> subprocess.Popen[str]:
    """Wait for ``old`` to exit (cleanly) and start a replica on its port again."""
    assert old.wait(timeout=60) == 0
    port = url.rsplit(":", 1)[1]
    return start_server(model, *extra, port=int(port))[0]


def get_json_metric(base: str, name: str) -> float:
    """The sum of a Prometheus counter's samples at ``base``/metrics."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_dp_without_the_router_installed_is_a_clear_error(monkeypatch: Any) -> None:
    from asyncinfer.cli import build_parser
    from asyncinfer.errors import ConfigError
    from asyncinfer.server.replicas import serve_replicas

    monkeypatch.setitem(sys.modules, "sglang_router", None)
    args = build_parser().parse_args(["serve", "--dp", "2"])
    with pytest.raises(ConfigError, match=r"pip install 'asyncinfer\[router\]'"):
        serve_replicas(args)


def test_bench_serve_through_the_router_reports_each_replica(replicas: tuple[str, list[str]],
                                                             tmp_path: Path) -> None:
    """`asyncinfer bench serve` at the router: prompts go as text (the router refuses ids),
    and the report has a row per replica whose requests add up to the run's, with the
    prompt tokens each served from its prefix cache."""
    from asyncinfer.cli import main

    router, workers = replicas
    out = tmp_path / "bench.json"
    assert main(["bench", "serve", "--url", router, "--num-requests", "6", "--concurrency",
                 "1", "--input-len", "8", "--output-len", "2", "--prefix-groups", "2",
                 "--prefix-len", "64", "--seed", "5", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["params"]["prompt_format"] == "text" and report["completed"] == 6
    rows = {row["url"]: row for row in report["replicas"]}
    assert set(rows) == set(workers)
    assert sum(row["requests"] for row in rows.values()) == 6
    assert sum(row["generation_tokens"] for row in rows.values()) == 12
    # Four of the six requests follow one of their group's: 4 x 64 prefix tokens could be
    # cached; whole pages of them are, wherever the router sent them.
    assert 0 < sum(row["prefix_cache_hit_tokens"] for row in rows.values()) <= 4 * 72
