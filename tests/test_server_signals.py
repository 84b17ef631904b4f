"""A real `asyncinfer serve` and the signals a terminal, an operator or a crash send it: SIGHUP
drains as SIGTERM does, an idle Ctrl-C stops at once, and no exit leaves a temporary
directory behind (kill -9 of the server process included)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.test_server_process import descendants, none_left, spawned, start_server


def serve(model: Path, tmp: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    """`asyncinfer serve` in a session of its own (a terminal's hang-up reaches every process
    of it), its temporary files under ``tmp``, once /health says ok."""
    return start_server(model, *extra, env={**os.environ, "TMPDIR": str(tmp)},
                        own_session=True, timeout=300)


def leftovers(tmp: Path) -> list[str]:
    """What a run left in its temporary directory (torch's compile cache, shared by every
    run of the user, aside)."""
    return sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))


async def test_sighup_to_the_session_drains_a_stream_to_its_end_and_exits_0(
        served_model: Path, tmp_path: Path) -> None:
    """A terminal's hang-up (SIGHUP to every process of the session) with a stream in
    flight: the stream ends as it would have, with [DONE]; the server exits 0 and leaves
    no temporary directory and no process."""
    import aiohttp

    proc, url = serve(served_model, tmp_path)
    try:
        children = descendants(proc.pid)
        body = {"prompt": "Count: 1, 2,", "max_tokens": 24, "ignore_eos": True,
                "stream": True}
        async with aiohttp.ClientSession() as session:
            stream = await session.post(f"{url}/v1/completions", json=body)
            assert stream.status == 200
            await stream.content.readline()
            os.killpg(proc.pid, signal.SIGHUP)
            events = [e for e in (await stream.text()).split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] == (
            "length")
        code = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 120)
        assert code == 0, proc.stderr.read() if proc.stderr else ""
        assert none_left(children)
        assert leftovers(tmp_path) == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_an_idle_ctrl_c_stops_at_once_saying_nothing_was_in_flight(
        served_model: Path, tmp_path: Path) -> None:
    """Ctrl-C of a server with nothing in flight: it says so and exits 0, far sooner than a
    drain timeout of 600 s would let it."""
    proc, _ = serve(served_model, tmp_path, "--shutdown-timeout", "600")
    try:
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=120)
        err = proc.stderr.read() if proc.stderr else ""
        assert code == 0, err
        assert "shutting down: nothing in flight, stopping now" in err, err
        assert "draining" not in err, err
        assert leftovers(tmp_path) == []
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("victim", ["server", "front 1"])
def test_kill_9_of_a_front_leaves_no_temporary_directory(
        served_model: Path, tmp_path: Path, victim: str) -> None:
    """kill -9 of the server process (front 0) or of another front: every other process
    stops and the sockets' directory is gone."""
    proc, _ = serve(served_model, tmp_path, "--api-workers", "2")
    try:
        children = descendants(proc.pid)
        assert [p for p in leftovers(tmp_path) if p.startswith("asyncinfer-")]
        if victim == "server":
            os.kill(proc.pid, signal.SIGKILL)
        else:
            _, front = sorted(spawned(proc.pid))  # the core starts first
            os.kill(front, signal.SIGKILL)
        proc.wait(timeout=120)
        assert none_left(children, timeout=120)
        assert leftovers(tmp_path) == []
    finally:
        if proc.poll() is None:
            proc.kill()



def gone_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_front_whose_server_died_before_it_ran_stops_by_itself(served_model: Path,
                                                                 tmp_path: Path) -> None:
    """A front that starts after its server process and the engine core are gone (kill -9
    of the server while it spawns fronts) exits 1 instead of serving a dead core forever."""
    import multiprocessing
    import socket

    from asyncinfer.cli import build_parser
    from asyncinfer.ipc.messages import Addresses, CoreInfo
    from asyncinfer.server.main import _front_process

    args = build_parser().parse_args(["serve", "--model", str(served_model)])
    info = CoreInfo(gone_pid(), "m", str(served_model), 2048, 16)
    listener = socket.create_server(("127.0.0.1", 0))
    front = multiprocessing.get_context("spawn").Process(
        target=_front_process,
        args=(args, info, Addresses(str(tmp_path)), 1, 2, listener, False, gone_pid()))
    front.start()
    front.join(120)
    if front.is_alive():
        front.kill()
    assert front.exitcode == 1
