"""A first `asyncinfer serve` on an empty cache: the port answers from the moment it is bound,
503 naming the step (fetching, converting, loading) with Retry-After, until the engine is
ready; then the same curl is answered. And a long start-up step says it is still at it."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from asyncinfer.models.progress import on_step, step
from tests.test_first_run import _free_port, _pip_from, package_index

__all__ = ["package_index"]  # the fixture, from the first-run suite


def _ask(url: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, str], Any]:
    """Status, headers and JSON body of a GET (or of a POST of ``body``)."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def test_a_first_start_answers_503_naming_each_step_until_ready(
        package_index: str, tmp_path: Path) -> None:
    port = _free_port()
    env = {**_pip_from(package_index), "ASYNCINFER_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "asyncinfer.cli", "serve", "--port", str(port),
           "--dtype", "float32", "--max-running-requests", "2", "--kv-cache-gb", "0.01"]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr or []), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    completion = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
    steps: list[str] = []
    refusals: list[tuple[int, str, Any]] = []
    try:
        deadline = time.monotonic() + 300  # a bound for a hung start, not a measurement
        while True:
            assert proc.poll() is None, "serve exited:\n" + "".join(lines)
            assert time.monotonic() < deadline, "never ready:\n" + "".join(lines)
            try:
                status, headers, health = _ask(f"{url}/health")
            except OSError:  # the port is not bound yet
                time.sleep(0.05)
                continue
            if status == 200:
                break
            assert status == 503 and health["status"] == "starting", health
            assert headers["Retry-After"].isdigit()
            steps.append(health["step"])
            status, headers, body = _ask(f"{url}/v1/completions", completion)
            if status == 200:  # it became ready between the two calls
                break
            refusals.append((status, headers.get("Retry-After", ""), body["error"]))
            time.sleep(0.05)
        status, _, answer = _ask(f"{url}/v1/completions", completion)
        assert status == 200 and answer["usage"]["completion_tokens"] == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    # The conversion alone takes many polls: the port answered while the model was fetched
    # or converted, naming the step, and refused generation the same way.
    assert steps and all(steps), steps
    assert any(s.startswith(("fetching", "downloading", "converting")) for s in steps), steps
    for status, retry, error in refusals:
        assert status == 503 and retry.isdigit(), (status, retry, error)
        assert error["code"] == "server_starting" and "the server is starting (" in (
            error["message"]), error


def test_a_long_step_says_it_is_still_at_it() -> None:
    said: list[str] = []
    heard = threading.Event()

    def listen(text: str) -> None:
        said.append(text)
        if "still at it" in text:
            heard.set()

    stop = on_step(listen)
    try:
        with step("converting a model: writing %s", "the weights", every=0.01):
            assert heard.wait(30)
    finally:
        stop()
    assert said[0] == "converting a model: writing the weights"
    assert said[1].startswith("converting a model: writing the weights: still at it ("), said


def test_a_progress_dropped_unclosed_stops_saying_it_is_still_at_it(
        caplog: pytest.LogCaptureFixture) -> None:
    """A step that failed mid-way (its Progress never closed) falls silent once dropped."""
    import gc

    from asyncinfer.models.progress import Progress

    caplog.set_level(logging.INFO, logger="asyncinfer.models.progress")
    said: list[str] = []
    stop = on_step(said.append)
    try:
        progress = Progress("loading", 10, unit="tensors", every=0.01, bar=False)
        beating = [t for t in threading.enumerate() if t.name == "asyncinfer-progress"]
        assert beating
        del progress
        gc.collect()
        for thread in beating:
            thread.join(30)
        assert not any(t.is_alive() for t in beating)
    finally:
        stop()
    assert said[0] == "loading (10 tensors)"


def test_a_download_without_pips_progress_lines_is_counted_in_bytes(tmp_path: Path) -> None:
    """An older pip prints no progress: the bytes it writes in its temporary directory are
    counted as they grow."""
    from asyncinfer.models.fetch import _watch_size
    from asyncinfer.models.progress import Progress

    progress = Progress("downloading a wheel", bar=False)
    done = threading.Event()
    watcher = threading.Thread(target=_watch_size, args=(tmp_path, progress, done))
    watcher.start()
    try:
        (tmp_path / "partial").mkdir()
        (tmp_path / "partial" / "wheel.part").write_bytes(bytes(300_000))
        deadline = time.monotonic() + 60  # a poll bound, not a measurement
        while progress.done < 300_000:
            assert time.monotonic() < deadline, progress.done
            time.sleep(0.05)
    finally:
        done.set()
        watcher.join(30)
    assert progress.done == 300_000
    progress.close()
