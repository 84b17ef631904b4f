"""The CPU thread count and OpenMP's wait: the cores a process may use (affinity and cgroup
quota), who decides the count, and a short spin at barriers set before OpenMP loads, unless
the user has said how threads wait."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncinfer import threads


def _cgroup_v2(root: Path, cpu_max: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cpu.max").write_text(cpu_max + "\n")
    return root


def _cgroup_v1(root: Path, quota: int, period: int) -> Path:
    (root / "cpu").mkdir(parents=True, exist_ok=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text(f"{period}\n")
    return root


@pytest.mark.parametrize(("make", "quota"), [
    (lambda root: _cgroup_v2(root, "max 100000"), None),
    (lambda root: _cgroup_v2(root, "150000 100000"), 1.5),
    (lambda root: _cgroup_v2(root, "50000 100000"), 0.5),
    (lambda root: _cgroup_v2(root, "100000 50000"), 2.0),
    (lambda root: _cgroup_v1(root, 300000, 100000), 3.0),
    (lambda root: _cgroup_v1(root, -1, 100000), None),
    (lambda root: root, None),
])
def test_the_cores_are_the_affinity_capped_by_the_cgroup_quota(
        tmp_path: Path, make: object, quota: float | None) -> None:
    root = make(tmp_path / "cgroup")  # type: ignore[operator]
    affinity = len(os.sched_getaffinity(0))
    expected = affinity if quota is None else max(1, min(affinity, math.ceil(quota)))
    assert threads.available_cores(root) == expected


def test_the_count_is_the_one_given_else_omp_num_threads_else_the_cores_per_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "available_cores", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.cpu_threads(3) == 3
    assert threads.cpu_threads(None) == 8
    assert threads.cpu_threads(None, ranks=2) == 4
    assert threads.cpu_threads(None, ranks=16) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert threads.cpu_threads(None) == 1 and threads.cpu_threads(None, ranks=2) == 1
    assert threads.cpu_threads(5) == 5
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert threads.cpu_threads(None) == 8


@pytest.mark.parametrize("chosen", ["OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"])
def test_a_wait_the_user_chose_is_left_alone(chosen: str) -> None:
    assert threads.omp_environment({chosen: "1"}) == {}
    assert threads.omp_environment({}) == {"GOMP_SPINCOUNT": threads.SPIN_COUNT}


def test_the_command_line_sets_the_wait_before_openmp_loads_in_its_children() -> None:
    """``asyncinfer`` sets it first thing, so the engine core it starts (a fresh
    interpreter) loads OpenMP with it; a variable the user set wins."""
    probe = ("import os, sys\n"
             "from asyncinfer import cli\n"
             "sys.argv = ['asyncinfer', 'policies']\n"
             "cli.main()\n"
             "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY",
                                                             "KMP_BLOCKTIME")}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    assert out[-2:] == [threads.SPIN_COUNT, "None"]
    out = subprocess.run([sys.executable, "-c", probe], env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out[-2:] == ["None", "ACTIVE"]


# Where a 20 MiB malloc lies ("heap" or "mapped"), and whether the heap still holds its
# pages once it is freed ("kept" or "trimmed").
_HEAP_PROBE = (
    "import ctypes\n"
    "libc = ctypes.CDLL('libc.so.6')\n"
    "libc.malloc.restype = ctypes.c_void_p\n"
    "libc.malloc.argtypes = [ctypes.c_size_t]\n"
    "libc.free.argtypes = [ctypes.c_void_p]\n"
    "def heap():\n"
    "    for line in open('/proc/self/maps'):\n"
    "        if line.rstrip().endswith('[heap]'):\n"
    "            lo, hi = (int(x, 16) for x in line.split()[0].split('-'))\n"
    "            return lo, hi\n"
    "    return 0, 0\n"
    "at = libc.malloc(20 << 20)\n"
    "lo, hi = heap()\n"
    "libc.free(at)\n"
    "kept = heap()[1] - heap()[0] >= 20 << 20\n"
    "print(('heap' if lo <= at < hi else 'mapped') + ('-kept' if kept else '-trimmed'))\n")


@pytest.mark.skipif(not sys.platform.startswith("linux")
                    or "CS_GNU_LIBC_VERSION" not in os.confstr_names
                    or not os.confstr("CS_GNU_LIBC_VERSION"), reason="glibc's tunables")
def test_a_process_started_by_the_command_line_keeps_big_buffers_in_its_heap() -> None:
    """A 20 MiB buffer, a forward's activation at a few thousand tokens, comes from the
    heap of a process started with the command line's environment, and its pages stay there
    once it is freed, where glibc's defaults map it afresh (and unmap it when freed);
    tunables the user set win."""
    probe = ("import os, subprocess, sys\n"
             "from asyncinfer import cli\n"
             "sys.argv = ['asyncinfer', 'policies']\n"
             "cli.main()\n"
             f"subprocess.run([sys.executable, '-c', {_HEAP_PROBE!r}], check=True)\n")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}

    def where(environ: dict[str, str], code: str) -> str:
        return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                              text=True, timeout=120, check=True).stdout.split()[-1]

    assert where(env, _HEAP_PROBE).startswith("mapped")
    assert where(env, probe) == "heap-kept"
    assert threads.malloc_environment(env) == {"GLIBC_TUNABLES": threads.MALLOC_TUNABLES}
    chosen = {**env, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert threads.malloc_environment(chosen) == {}
    assert where(chosen, probe).startswith("mapped")


async def test_an_engine_computes_with_the_threads_it_was_given(tiny_llama_dir: Path) -> None:
    """The count holds in the thread the engine computes in (OpenMP's count is per
    thread: the caller's is left as it was)."""
    import torch

    from tests.test_async_engine import greedy, tiny_engine

    before = torch.get_num_threads()
    engine = tiny_engine(tiny_llama_dir, cpu_threads=1)
    assert engine._compute is not None  # the compute thread, before the engine starts
    assert engine._compute.submit(torch.get_num_threads).result() == 1
    assert engine.runner.cpu_threads == 1 and torch.get_num_threads() == before
    assert engine.runner.thread_tuner is None  # a count given stays as given
    async with engine:
        assert len((await engine.generate([3, 4, 5], greedy(3))).token_ids) == 3


class _Machine:
    """A clock and a run-delay reading that the test moves forward by hand."""

    def __init__(self) -> None:
        self.now, self.delay, self.counts = 0.0, 0.0, []

    def advance(self, seconds: float, waiting: float) -> None:
        """``seconds`` pass, with the threads waiting ``waiting`` seconds per second."""
        self.now += seconds
        self.delay += seconds * waiting


def _tuner(machine: _Machine, most: int = 2) -> threads.ThreadTuner:
    return threads.ThreadTuner(most, machine.counts.append, delays=lambda: machine.delay,
                               clock=lambda: machine.now, interval=0.5, probe_every=10.0)


def test_the_tuner_drops_a_thread_while_cores_are_taken_and_comes_back_when_freed() -> None:
    machine = _Machine()
    tuner = _tuner(machine)
    for _ in range(10):                     # quiet: the threads hardly wait
        machine.advance(0.5, 0.006)
        tuner.step()
    assert tuner.threads == 2 and machine.counts == []
    machine.advance(0.5, 0.9)               # a burst of another process's work: kept
    tuner.step()
    machine.advance(0.5, 0.006)
    tuner.step()
    assert machine.counts == []
    machine.advance(0.5, 0.73)              # another process takes a core: two looks
    tuner.step()
    assert machine.counts == []
    machine.advance(0.5, 0.73)
    tuner.step()
    assert tuner.threads == 1 and machine.counts == [1]
    for _ in range(19):                     # one thread waits no more; no try before 10 s
        machine.advance(0.5, 0.009)
        tuner.step()
    assert machine.counts == [1]
    machine.advance(0.5, 0.009)
    tuner.step()                            # 10 s on: one more, tried
    assert machine.counts == [1, 2]
    machine.advance(0.5, 0.7)               # still taken: back to one at the next look,
    tuner.step()                            # and the next try waits twice as long
    assert machine.counts == [1, 2, 1]
    for _ in range(39):
        machine.advance(0.5, 0.005)
        tuner.step()
    assert machine.counts == [1, 2, 1]
    machine.advance(0.5, 0.005)             # 20 s on, the other process has gone
    tuner.step()
    assert machine.counts == [1, 2, 1, 2] and tuner.threads == 2
    for _ in range(40):                     # and the count stays
        machine.advance(0.5, 0.005)
        tuner.step()
    assert machine.counts == [1, 2, 1, 2]


def test_the_tuner_looks_at_most_every_interval_and_never_below_one_thread() -> None:
    machine = _Machine()
    tuner = _tuner(machine, most=3)
    machine.advance(0.2, 2.0)
    tuner.step()
    assert machine.counts == []             # under the interval: not looked at
    for _ in range(8):
        machine.advance(0.5, 2.0)
        tuner.step()
    assert tuner.threads == 1 and machine.counts == [2, 1]


def test_without_schedstat_the_count_stays() -> None:
    counts: list[int] = []
    clock = iter(range(100))
    tuner = threads.ThreadTuner(2, counts.append, delays=lambda: None,
                                clock=lambda: float(next(clock)))
    for _ in range(20):
        tuner.step()
    assert counts == [] and tuner.threads == 2


def test_run_delay_is_read_from_this_processs_threads() -> None:
    delay = threads.run_delay_seconds()
    if delay is None:
        pytest.skip("this kernel keeps no schedstat")
    assert delay >= 0.0
    assert threads.run_delay_seconds(Path("/nonexistent")) is None


async def test_by_default_an_engine_tunes_its_threads_unless_the_user_chose(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_async_engine import tiny_engine

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    engine = tiny_engine(tiny_llama_dir)
    tuner = engine.runner.thread_tuner
    assert tuner is not None and tuner.most == engine.runner.cpu_threads == 2
    await engine.close()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    engine = tiny_engine(tiny_llama_dir)
    assert engine.runner.thread_tuner is None
    await engine.close()


def test_batch_invariant_tokens_and_logprobs_do_not_depend_on_the_thread_count(
        tiny_llama_dir: Path) -> None:
    """The tuner may change the count between rounds: the kernels split work over outputs,
    never a sum, so a batch-invariant engine answers alike with one thread or two."""
    from asyncinfer import LLM, SamplingParams

    prompts = [[3 + i, 40 + 2 * i, 7, 9 + i] * (3 + i) for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, logprobs=2,
                            ignore_eos=True)
    seen = []
    for count in (1, 2):
        llm = LLM(str(tiny_llama_dir), skip_tokenizer_init=True, dtype="bfloat16",
                  batch_invariant=True, cpu_threads=count, page_size=4, num_pages=64,
                  max_seq_len=64)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.close()
        seen.append([(o.token_ids, [e.logprob for e in o.logprobs]) for o in outs])
    assert seen[0] == seen[1]


async def test_the_tuner_drops_a_thread_within_one_long_forward(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill of thousands of tokens is one forward that lasts seconds: the tuner looks
    before each layer too, so cores taken away during the first forward lose it a thread
    before the forward ends (one look per forward would need two forwards)."""
    from tests.test_async_engine import greedy, tiny_engine

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    engine = tiny_engine(tiny_llama_dir)
    tuner = engine.runner.thread_tuner
    assert tuner is not None and tuner.threads == 2
    assert len(engine.runner.model.layers) >= 2
    now = [0.0]
    taken: list[int] = []

    def clock() -> float:  # every look finds a second gone, the threads waiting all of it
        now[0] += 1.0
        return now[0]

    tuner._clock, tuner._delays = clock, lambda: now[0]
    tuner._since = tuner._delay = tuner._probe_at = 0.0
    tuner._set = taken.append
    async with engine:
        await engine.generate([5, 6, 7], greedy(1))  # one forward
    assert taken == [1] and tuner.threads == 1
