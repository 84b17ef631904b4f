"""How many threads the CPU engine computes with, and how OpenMP's threads wait.

The cores a process may use are its CPU affinity, capped by its cgroup's CPU quota (a
container given 1.5 CPUs of a 64-core host has 2, not 64). OpenMP's threads, torch's and
the kernels' (the same runtime), spin at every barrier before they sleep; when another
process holds one of the cores, the spinning thread takes the core the thread it waits
for needs. See docs/architecture.md, "CPU threads". The processes that compute also start
with glibc's heap set for a forward's big, short-lived buffers ("The C heap")."""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path

__all__ = ["ThreadTuner", "available_cores", "cpu_threads", "malloc_environment", "omp_environment",
           "run_delay_seconds", "set_compute_environment", "threads_chosen"]

logger = logging.getLogger(__name__)

# The variables OpenMP reads once, when its runtime loads (with torch): whoever sets one of
# them has chosen, and is left alone.
_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
# How long a thread spins at a barrier before it sleeps, in libgomp's iterations: a few
# microseconds, where libgomp's own default spins about a thousand times longer.
SPIN_COUNT = "10000"
# glibc's malloc in the processes that compute: allocations under 32 MiB (its largest mmap
# threshold) from the heap, and up to 256 MiB of freed heap kept. Its defaults map a big
# buffer afresh and unmap it once freed, so a forward's activations (tens of MiB at a few
# thousand tokens) faulted fresh pages in, page by page, at every forward (docs/
# architecture.md, "The C heap").
MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=268435456"


def _cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPUs the cgroup's quota allows (cgroup v2 ``cpu.max``, else v1's CFS files), or
    None where there is none."""
    try:
        quota, *period = (root / "cpu.max").read_text().split()
        if quota != "max":
            return int(quota) / int(period[0] if period else 100000)
        return None
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def available_cores(root: Path = Path("/sys/fs/cgroup")) -> int:
    """The cores this process may compute on: its affinity, at most its cgroup's quota
    (rounded up), at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    quota = _cgroup_quota(root)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def omp_environment(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """What to add to a process's environment before OpenMP loads in it: a short spin at
    barriers, unless the environment already says how threads wait."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in _WAIT_VARIABLES):
        return {}
    return {"GOMP_SPINCOUNT": SPIN_COUNT}


def malloc_environment(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """What to add to the environment of a process to be started, for its C heap: glibc's
    tunables MALLOC_TUNABLES, unless the environment already sets tunables of its own."""
    environ = os.environ if environ is None else environ
    if "GLIBC_TUNABLES" in environ or not sys.platform.startswith("linux"):
        return {}
    return {"GLIBC_TUNABLES": MALLOC_TUNABLES}


def set_compute_environment() -> None:
    """Add :func:`omp_environment` and :func:`malloc_environment` to this process's
    environment, for the processes it starts (an engine core, tensor-parallel ranks,
    replicas) and for its own OpenMP if it has not loaded yet (its heap stays as it
    started: glibc reads its tunables once, as a process starts)."""
    os.environ.update(omp_environment())
    os.environ.update(malloc_environment())


def _omp_num_threads() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def threads_chosen(given: int | None) -> bool:
    """Whether the user chose the count (``cpu_threads`` or ``OMP_NUM_THREADS``): then it
    stays as chosen."""
    return given is not None or _omp_num_threads() is not None


def cpu_threads(given: int | None, ranks: int = 1) -> int:
    """The threads each of ``ranks`` ranks computes with: ``given``, else
    ``OMP_NUM_THREADS`` where it is a number, else the available cores shared out."""
    if given is not None:
        return given
    return _omp_num_threads() or max(1, available_cores() // ranks)


def run_delay_seconds(tasks: Path = Path("/proc/self/task")) -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a core, summed
    since they started (the scheduler's ``schedstat``), or None where it is not kept."""
    total = 0
    try:
        names = os.listdir(tasks)
    except OSError:
        return None
    for name in names:
        try:
            total += int((tasks / name / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that has just ended
    return total / 1e9 if names else None


class ThreadTuner:
    """Between rounds, the number of threads the engine computes with: one fewer while its
    threads wait for cores that another process holds (two looks in a row), and a try with
    one more after ``probe_every`` seconds, kept where the wait does not come back (each
    try that fails doubles the time to the next, up to ``longest_wait``). See
    docs/architecture.md, "CPU threads"."""

    def __init__(self, most: int, set_threads: Callable[[int], None],
                 delays: Callable[[], float | None] = run_delay_seconds,
                 clock: Callable[[], float] = time.monotonic, interval: float = 0.5,
                 probe_every: float = 10.0, longest_wait: float = 80.0) -> None:
        self.most = self.threads = most
        self._set, self._delays, self._clock = set_threads, delays, clock
        self.interval, self.probe_every, self.longest_wait = interval, probe_every, longest_wait
        self._since, self._delay = clock(), delays() or 0.0
        self._probe_at = self._since
        self._wait = probe_every   # until the next try
        self._trying = False       # the last change was a try with one more
        self._strikes = 0          # looks in a row that found the threads waiting

    def contended(self, rate: float) -> bool:
        """Whether waiting ``rate`` seconds per second means another process holds a core:
        a quarter of a core's time or more, more with many threads (each waits a little at
        every wake-up)."""
        return rate > max(0.25, 0.02 * self.threads)

    def step(self) -> None:
        """Called before a forward and before each of its layers (a long prefill is one
        forward), in the thread that computes it."""
        now = self._clock()
        if now - self._since < self.interval:
            return
        delay = self._delays()
        if delay is None:
            return
        rate = (delay - self._delay) / (now - self._since)
        self._since, self._delay = now, delay
        # Two looks in a row, or one just after a try: a burst of another process's work
        # (a client tokenizing its prompts) is not a core taken away.
        self._strikes = self._strikes + 1 if self.contended(rate) else 0
        if self.threads > 1 and (self._strikes >= 2 or (self._strikes and self._trying)):
            self._strikes = 0
            self._change(self.threads - 1, f"its threads waited {rate:.2f} s/s for cores")
            self._wait = min(2 * self._wait, self.longest_wait) if self._trying \
                else self.probe_every
            self._trying = False
            self._probe_at = now + self._wait
        elif self._trying:  # the try held: the cores are free again
            self._trying, self._wait = False, self.probe_every
            self._probe_at = now + self._wait
        elif self.threads < self.most and now >= self._probe_at:
            self._change(self.threads + 1, "trying one more")
            self._trying = True

    def _change(self, threads: int, why: str) -> None:
        logger.debug("CPU threads %d -> %d: %s", self.threads, threads, why)
        self.threads = threads
        self._set(threads)
