"""A real `asyncinfer serve` process on a loopback port, driven by aiohttp and by the official
openai client: text and chat completions, streamed and not, equal LLM.generate's outputs;
a storm of streams with hang-ups leaves nothing held. The suite runs on one rank and on two
tensor-parallel ranks (`--tp 2`, every batch compared across the ranks)."""

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
from typing import Any

import pytest

from asyncinfer.api import LLM
from asyncinfer.params import SamplingParams
from tests.conftest import engine_under_test
from tests.test_server_hostile import storm_with_hang_ups

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = "What is the capital of France?"
MAX_TOKENS = 12
NAME = "SmolLM2-135M-Instruct"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def served(model: Path, *extra: str) -> Iterator[str]:
    """The URL of an `asyncinfer serve` of ``model`` while the block runs; then Ctrl-C,
    which must end it with status 0."""
    import signal

    proc, url = start_server(model, *extra)
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0


def start_server(model: Path, *extra: str, port: int | None = None,
                 env: dict[str, str] | None = None, own_session: bool = False,
                 timeout: float = 120) -> tuple[subprocess.Popen[str], str]:
    """An `asyncinfer serve` process as `launch_server` starts it, once /health says ok
    (killed if it does not within ``timeout`` seconds, a bound for a hung start)."""
    proc, url = launch_server(model, *extra, port=port, env=env, own_session=own_session)
    import urllib.request

    deadline = time.monotonic() + timeout
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


def launch_server(model: Path, *extra: str, port: int | None = None,
                  env: dict[str, str] | None = None,
                  own_session: bool = False) -> tuple[subprocess.Popen[str], str]:
    """An `asyncinfer serve` process on ``port`` (default: a free loopback port), just
    started, with ``env`` (default: this one's environment); with ``own_session``, in a
    session of its own (a terminal's hang-up reaches every process of it)."""
    port = port or _free_port()
    _, target = engine_under_test()
    cmd = [sys.executable, "-m", "asyncinfer.cli", "serve", "--port", str(port),
           "--model", str(model), "--served-model-name", NAME,
           "--device", target["device"], "--dtype", target["dtype"],
           "--max-running-requests", "4", "--kv-cache-gb", "0.5",
           "--cache-type", target["cache_type"], *extra]
    proc = subprocess.Popen(cmd, env=os.environ.copy() if env is None else env,
                            stdin=subprocess.DEVNULL if own_session else None,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=own_session)
    return proc, f"http://127.0.0.1:{port}"


def tensor_parallel(ranks: int) -> tuple[str, ...]:
    """The flags of a server on ``ranks`` tensor-parallel ranks (skipped where the device
    has too few), comparing every batch across them."""
    _, target = engine_under_test()
    if ranks > 1 and target["device"] != "cpu":
        import torch

        if torch.cuda.device_count() < ranks:
            pytest.skip(f"--tp {ranks} needs {ranks} GPUs")
    return ("--tp", str(ranks), "--tp-guard-interval", "1") if ranks > 1 else ()


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def case(request: pytest.FixtureRequest) -> tuple[Path, tuple[str, ...]]:
    """The model and flags of a suite's server: the served model on one rank; on two, a
    small random Llama with SmolLM2's tokenizer (SmolLM2's 9 heads do not split in two)."""
    if request.param == 1:
        return request.getfixturevalue("served_model"), ()
    flags = tensor_parallel(request.param)
    return two_rank_model(request), flags


def two_rank_model(request: pytest.FixtureRequest) -> Path:
    """A model whose heads split in two: the one under test if one is given (the GPU run's
    random chat model), else a small random Llama with SmolLM2's tokenizer."""
    model, _ = engine_under_test()
    if model is not None:
        return Path(model)
    return Path(request.getfixturevalue("tiny_chat_llama_dir"))


@pytest.fixture(scope="module")
def server(case: tuple[Path, tuple[str, ...]]) -> Iterator[str]:
    proc, url = start_server(case[0], *case[1])
    children = descendants(proc.pid)
    try:
        yield url
    finally:
        import signal

        proc.send_signal(signal.SIGINT)  # Ctrl-C (SIGTERM: the tests below)
        assert proc.wait(timeout=60) == 0, "Ctrl-C ends the server cleanly"
        assert none_left(children), "and every process it started, every rank"


@pytest.fixture(scope="module")
def expected(case: tuple[Path, tuple[str, ...]]) -> dict[str, str]:
    """One rank's greedy texts of the suite's prompts, by LLM.generate."""
    _, target = engine_under_test()
    llm = LLM(str(case[0]), max_running_requests=4, kv_cache_gb=0.5, **target)
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


class _Session:
    """An aiohttp session posting to ``url``'s paths, as the hostile suite's test client."""

    def __init__(self, session: Any, url: str) -> None:
        self.session, self.url = session, url

    def post(self, path: str, **kwargs: Any) -> Any:
        return self.session.post(f"{self.url}{path}", **kwargs)


async def test_a_storm_with_hang_ups_leaves_nothing_held(server: str) -> None:
    """60 concurrent streams, every third client hanging up after its first chunk: the rest
    end with [DONE], and then the engine (every rank) runs, queues and holds nothing."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        await storm_with_hang_ups(_Session(session, server), 60, max_tokens=8)
        await nothing_held(session, server, timeout=30)


async def nothing_held(session: Any, url: str, timeout: float) -> str:
    """Polls ``url``'s /metrics until nothing runs, waits or holds a KV page (failing after
    ``timeout`` seconds, a bound for a loaded machine); the last metrics text."""
    deadline = time.monotonic() + timeout
    while True:
        async with session.get(f"{url}/metrics") as response:
            text = await response.text()
        held = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith(("asyncinfer_requests_running ",
                                    "asyncinfer_requests_waiting ",
                                    "asyncinfer_kv_pages_used "))}
        if len(held) == 3 and not any(held.values()):
            return str(text)
        assert time.monotonic() < deadline, held
        await asyncio.sleep(0.1)


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


async def test_two_api_workers_serve_and_stop_together(case: tuple[Path, tuple[str, ...]],
                                                       expected: dict[str, str]) -> None:
    """Two front processes on one port and the engine core (with its second rank under
    --tp 2): every answer right, and SIGTERM stops every process, the server exiting 0."""
    import aiohttp

    proc, url = start_server(case[0], *case[1], "--api-workers", "2")
    try:
        children = descendants(proc.pid)
        assert len(spawned(proc.pid)) == 2 + bool(case[1]), (
            "the engine core, the second front, and the core's second rank")
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


@pytest.mark.parametrize("moment", ["core loading", "fronts starting"])
async def test_sigterm_while_starting_exits_0_and_leaves_nothing(
        case: tuple[Path, tuple[str, ...]], moment: str) -> None:
    """SIGTERM while the engine core loads the model, or once it is up and the fronts are
    starting (before any front watches for signals): the server stops, exits 0, and no
    process of it is left."""
    proc, _ = launch_server(case[0], *case[1], "--api-workers", "2")
    # The core (and its second rank under --tp 2), then the second front.
    count = 1 if moment == "core loading" else 2 + bool(case[1])
    try:
        deadline = time.monotonic() + 120
        while len(spawned(proc.pid)) < count:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, f"no {moment} within 120 s"
            await asyncio.sleep(0.01)
        children = descendants(proc.pid)
        proc.terminate()
        code = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 60)
        assert code == 0, proc.stderr.read() if proc.stderr else ""
        assert none_left(children)
    finally:
        if proc.poll() is None:
            proc.kill()


async def all_unavailable(session: Any, url: str, wholes: list[Any], stream: Any,
                          body: dict[str, Any]) -> list[str]:
    """Every whole response 503 ``engine_unavailable``, the stream's last frame that error
    before [DONE], and a new request 503 too; the whole responses' messages."""
    import aiohttp

    messages = []
    for whole in wholes:
        response = await whole
        assert response.status == 503
        error = (await response.json())["error"]
        assert error["code"] == "engine_unavailable"
        messages.append(error["message"])
    events = [e for e in (await stream.text()).split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == "engine_unavailable"
    with contextlib.suppress(aiohttp.ClientError):
        async with session.post(f"{url}/v1/completions", json=body) as late:
            assert late.status == 503
    return messages


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
            await all_unavailable(session, url, wholes, stream, long)
            assert time.monotonic() - start < 1.0
        code = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
        assert code != 0
        assert "engine core" in (proc.stderr.read() if proc.stderr else "")
        assert none_left(children)
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_a_killed_tensor_parallel_rank_stops_every_rank_with_503s(
        request: pytest.FixtureRequest) -> None:
    """kill -9 of rank 1 of `serve --tp 2` mid-stream: the requests in flight and new ones
    get 503, the engine core (rank 0) says which rank is gone, the server exits non-zero,
    and no process is left."""
    import signal

    import aiohttp

    flags = tensor_parallel(2)
    proc, url = start_server(two_rank_model(request), *flags)
    long = {"prompt": "Count: 1, 2,", "max_tokens": 2000, "ignore_eos": True}
    try:
        children = descendants(proc.pid)
        core = spawned(proc.pid)[0]
        (rank1,) = [c for c in spawned(core)]
        async with aiohttp.ClientSession() as session:
            whole = asyncio.ensure_future(session.post(f"{url}/v1/completions", json=long))
            stream = await session.post(f"{url}/v1/completions", json={**long, "stream": True})
            assert stream.status == 200
            await stream.content.readline()
            os.kill(rank1, signal.SIGKILL)
            [message] = await all_unavailable(session, url, [whole], stream, long)
            assert f"rank 1 (pid {rank1}) was killed by SIGKILL" in message
        code = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
        assert code != 0
        log = proc.stderr.read() if proc.stderr else ""
        assert f"tensor-parallel rank 1 (pid {rank1}) was killed by SIGKILL" in log
        assert none_left(children)
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_header_bytes_that_are_not_utf8_are_a_400_and_hold_no_place(server: str) -> None:
    """X-Tenant: \\xff through the front and its engine client: 400 each, and afterwards
    nothing counts as waiting (a request that cannot be sent to the core holds no place)."""
    import aiohttp

    host, _, port = server.removeprefix("http://").partition(":")
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    for _ in range(5):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nX-Tenant: \xff\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 120)
        writer.close()
        assert head.startswith(b"HTTP/1.1 400"), head
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{server}/v1/completions", data=body,
                                headers={"Content-Type": "application/json"}) as response:
            assert response.status == 200
        deadline = time.monotonic() + 30
        while True:
            async with session.get(f"{server}/metrics") as response:
                text = await response.text()
            waiting = [float(line.split()[1]) for line in text.splitlines()
                       if line.startswith("asyncinfer_requests_waiting ")]
            if waiting == [0.0]:
                break
            assert time.monotonic() < deadline, waiting
            await asyncio.sleep(0.1)
