"""A real `asyncinfer serve` process on a loopback port, driven by aiohttp and by the official
openai client: text and chat completions, streamed and not, equal LLM.generate's outputs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncinfer.api import LLM
from asyncinfer.params import SamplingParams
from tests.conftest import engine_under_test

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = "What is the capital of France?"
MAX_TOKENS = 12
NAME = "SmolLM2-135M-Instruct"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    """An `asyncinfer serve` process on a free loopback port, once /health says ok."""
    port = _free_port()
    _, target = engine_under_test()
    cmd = [sys.executable, "-m", "asyncinfer.cli", "serve", "--port", str(port),
           "--model", str(model), "--served-model-name", NAME,
           "--device", target["device"], "--dtype", target["dtype"],
           "--max-running-requests", "4", "--kv-cache-gb", "0.5",
           "--cache-type", target["cache_type"], *extra]
    proc = subprocess.Popen(cmd, env=os.environ.copy(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    import urllib.request

    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stderr.read() if proc.stderr else ''}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                if response.status == 200:
                    return proc, url
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("server did not come up")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def server(served_model: Path) -> Iterator[str]:
    proc, url = start_server(served_model)
    try:
        yield url
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0, "SIGTERM ends the server cleanly"


@pytest.fixture(scope="module")
def expected(served_model: Path) -> dict[str, str]:
    _, target = engine_under_test()
    llm = LLM(str(served_model), max_running_requests=4, kv_cache_gb=0.5, **target)
    assert llm.tokenizer is not None
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    # One prompt at a time, as the clients below send them.
    outputs = [llm.generate([p], greedy, use_tqdm=False)[0] for p in PROMPTS]
    chat_ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": CHAT}])
    [chat] = llm.generate([chat_ids], greedy, use_tqdm=False)
    llm.close()
    return {**{p: o.text for p, o in zip(PROMPTS, outputs)}, CHAT: chat.text}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_openai_client_matches_llm_generate(server: str, expected: dict[str, str],
                                            stream: bool) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    for prompt in PROMPTS:
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(
                model=NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                temperature=0.0, stream=True) if c.choices)
        else:
            text = client.completions.create(model=NAME, prompt=prompt,
                                             max_tokens=MAX_TOKENS, temperature=0.0
                                             ).choices[0].text
        assert text == expected[prompt]
    messages = [{"role": "user", "content": CHAT}]
    if stream:
        chat = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=MAX_TOKENS,
            temperature=0.0, stream=True) if c.choices)
    else:
        chat = client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=MAX_TOKENS,
            temperature=0.0).choices[0].message.content or ""
    assert chat == expected[CHAT]


async def test_aiohttp_client_matches_llm_generate(server: str,
                                                   expected: dict[str, str]) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
            async with session.post(f"{server}/v1/completions", json=body) as response:
                assert response.status == 200
                data = await response.json()
            assert data["choices"][0]["text"] == expected[prompt]
            assert data["usage"]["completion_tokens"] <= MAX_TOKENS
        async with session.post(f"{server}/v1/completions",
                                json={"prompt": "x " * 9000, "max_tokens": 4}) as response:
            assert response.status == 400
            assert "error" in await response.json()


async def test_sigterm_drains_then_ends_what_is_left_and_exits_0(served_model: Path) -> None:
    """In flight at SIGTERM, and still running when --shutdown-timeout passes: a stream ends
    with an "abort" chunk and [DONE], a whole request gets 503. Meanwhile /health is 503 and
    new requests are refused; then the process exits 0. (That requests which finish in time
    finish normally is tested in-process: test_server_hostile.py.)"""
    import signal

    import aiohttp

    proc, url = start_server(served_model, "--shutdown-timeout", "0.5")
    # Longer than the drain on any device: 2,000 tokens are 2,000 decode steps.
    long = {"prompt": "Count: 1, 2,", "max_tokens": 2000, "ignore_eos": True}
    try:
        async with aiohttp.ClientSession() as session:
            whole = asyncio.ensure_future(session.post(f"{url}/v1/completions", json=long))
            stream = await session.post(f"{url}/v1/completions", json={**long, "stream": True})
            assert stream.status == 200
            await stream.content.readline()
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.05)
            async with session.get(f"{url}/health") as health:
                assert health.status == 503
            async with session.post(f"{url}/v1/completions", json={"prompt": "Hi"}) as late:
                assert late.status == 503
            events = [e for e in (await stream.text()).split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] == (
                "abort")
            resp = await whole
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "server_shutting_down"
        assert await asyncio.get_running_loop().run_in_executor(None, proc.wait, 60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return []
    return children + [d for c in children for d in descendants(c)]


def spawned(pid: int) -> list[int]:
    """The server's own processes below ``pid`` (multiprocessing's resource tracker aside)."""
    def cmdline(child: int) -> bytes:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                return f.read()
        except OSError:
            return b""

    return [c for c in descendants(pid) if b"spawn_main" in cmdline(c)]


def none_left(pids: list[int], timeout: float = 10.0) -> bool:
    """Whether every process of ``pids`` is gone within ``timeout`` seconds (multiprocessing's
    resource tracker exits once it sees its parent's end, a moment after it)."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


async def test_two_api_workers_serve_and_stop_together(served_model: Path,
                                                       expected: dict[str, str]) -> None:
    """Two front processes on one port and the engine core: every answer right, and SIGTERM
    stops all three processes, the server exiting 0."""
    import aiohttp

    proc, url = start_server(served_model, "--api-workers", "2")
    try:
        children = descendants(proc.pid)
        assert len(spawned(proc.pid)) == 2, "the engine core and the second front"
        body = {"model": NAME, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        async with aiohttp.ClientSession() as session:
            async def one(prompt: str) -> str:
                # A fresh connection each: the kernel hands them to either front.
                async with session.post(f"{url}/v1/completions", json={**body,
                                        "prompt": prompt}, headers={"Connection": "close"}
                                        ) as response:
                    assert response.status == 200
                    return str((await response.json())["choices"][0]["text"])

            texts = await asyncio.gather(*(one(p) for p in PROMPTS * 4))
        assert texts == [expected[p] for p in PROMPTS * 4]
        proc.terminate()
        assert await asyncio.get_running_loop().run_in_executor(None, proc.wait, 60) == 0
        assert none_left(children)
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_a_killed_engine_core_gets_503s_within_a_second_and_no_process_left(
        served_model: Path) -> None:
    """kill -9 of the core under load: the streams in flight end with a 503 error frame, the
    whole requests and new ones get 503 within a second, and the server exits non-zero
    without leaving a process behind."""
    import signal

    import aiohttp

    proc, url = start_server(served_model)
    long = {"prompt": "Count: 1, 2,", "max_tokens": 2000, "ignore_eos": True}
    try:
        (core,) = spawned(proc.pid)
        children = descendants(proc.pid)
        async with aiohttp.ClientSession() as session:
            wholes = [asyncio.ensure_future(session.post(f"{url}/v1/completions", json=long))
                      for _ in range(2)]
            stream = await session.post(f"{url}/v1/completions", json={**long, "stream": True})
            assert stream.status == 200
            await stream.content.readline()
            os.kill(core, signal.SIGKILL)
            start = time.monotonic()
            for whole in wholes:
                response = await whole
                assert response.status == 503
                assert (await response.json())["error"]["code"] == "engine_unavailable"
            events = [e for e in (await stream.text()).split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            assert json.loads(events[-2][len("data: "):])["error"]["code"] == (
                "engine_unavailable")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.post(f"{url}/v1/completions", json=long) as late:
                    assert late.status == 503
            assert time.monotonic() - start < 1.0
        code = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
        assert code != 0
        assert "engine core" in (proc.stderr.read() if proc.stderr else "")
        assert none_left(children)
    finally:
        if proc.poll() is None:
            proc.kill()
