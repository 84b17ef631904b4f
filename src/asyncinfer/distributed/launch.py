"""Rank 0 starts ranks 1..size-1 of a tensor-parallel engine as spawned processes. No rank
outlives the process that started it (docs/architecture.md, 'Starting the ranks')."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from asyncinfer.distributed.sync import watch_peers_in_this_process
from asyncinfer.errors import EngineError
from asyncinfer.processes import describe_exit, has_exited

logger = logging.getLogger(__name__)

START_TIMEOUT = 300.0   # seconds for every rank to join the group
# A rank's exit status when its start re-ran the user's script up to another start of ranks
# (sysexits' EX_CONFIG): the script lacks its main guard.
REENTERED = 78
NO_MAIN_GUARD = ("{script} starts the engine as it is imported, and each tensor-parallel rank "
                 "imports it (a spawned process does): put the code that starts the engine "
                 "under `if __name__ == \"__main__\":`")
STOP_TIMEOUT = 30.0     # seconds a rank gets to stop once told to, before it is killed
RANK_NAME = "asyncinfer-tp"  # a started rank's process name, less its number
LEAVE_TIMEOUT = 20.0    # seconds the ranks get to leave the group together, before abort


def backend_for(device: str) -> str:
    """The collectives' backend for a device string: NCCL on CUDA, gloo elsewhere."""
    return "nccl" if device.startswith("cuda") else "gloo"


class Ranks:
    """The processes of ranks 1..size-1, started by :meth:`launch` from rank 0."""

    def __init__(self, processes: list[Any]) -> None:
        self.processes = processes
        self._lock = threading.Lock()  # reaping a child twice at once loses its status
        self._ended: dict[int, str] = {}

    @classmethod
    def launch(cls, size: int, backend: str, entry: Callable[..., None],
               args: tuple[Any, ...]) -> Ranks:
        """Start ranks 1..size-1 running ``entry(rank, *args)`` and join their group as rank
        0; a rank that exits before the group forms is an EngineError naming it."""
        _refuse_reentry()
        import torch.distributed as dist

        port = _free_port()
        spawn = multiprocessing.get_context("spawn")
        processes = [spawn.Process(target=_rank_main, name=f"{RANK_NAME}{rank}", daemon=True,
                                   args=(rank, size, port, backend, os.getpid(), entry, args))
                     for rank in range(1, size)]
        ranks = cls(processes)
        for process in processes:
            process.start()
        failure: list[BaseException] = []

        def join() -> None:
            try:
                dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}",
                                        rank=0, world_size=size)
            except BaseException as exc:
                failure.append(exc)

        # Joined in a thread while the ranks are watched: one dying first would block it.
        joining = threading.Thread(target=join, name="asyncinfer-tp-join", daemon=True)
        joining.start()
        deadline = time.monotonic() + START_TIMEOUT
        try:
            while joining.is_alive():
                joining.join(0.1)
                gone = ranks.lost()
                if gone and REENTERED in (p.exitcode for p in processes):
                    raise EngineError(_no_main_guard())
                if gone:
                    raise EngineError(f"tensor-parallel {gone} while the ranks started")
                if time.monotonic() > deadline:
                    raise EngineError(f"the tensor-parallel ranks did not start within "
                                      f"{START_TIMEOUT:g} s")
            if failure:
                raise EngineError(f"the tensor-parallel ranks could not form a group: "
                                  f"{failure[0]}")
        except BaseException:
            ranks.stop(timeout=0.0)
            raise
        return ranks

    def lost(self) -> str | None:
        """The first rank whose process has exited, in words; None while all run."""
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                return self.describe(rank)
        return None

    def describe(self, rank: int) -> str | None:
        """Rank ``rank``'s exit in words, once its process has exited."""
        with self._lock:
            if rank not in self._ended:
                process = self.processes[rank - 1]
                process.join(0.5)  # reap it: its exit status says how it ended
                if process.exitcode is None:
                    return None
                self._ended[rank] = (f"rank {rank} (pid {process.pid}) "
                                     f"{describe_exit(process.exitcode)}")
            return self._ended[rank]

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Wait up to ``timeout`` s for the ranks (told to stop) to exit, then kill the rest."""
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                logger.warning("tensor-parallel %s (pid %d) did not stop; terminating it",
                               process.name, process.pid)
                process.terminate()
                process.join(5.0)
            if process.is_alive():
                process.kill()
                process.join()


def leave_group(timeout: float = LEAVE_TIMEOUT) -> bool:
    """Leave every process group; False, the group aborted instead, if that takes over
    ``timeout`` s (NCCL's teardown waits for a rank stuck in a collective for good)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return True
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group: left all the same
            logger.debug("leaving the process group failed", exc_info=True)
        done.set()

    threading.Thread(target=destroy, name="asyncinfer-leave-group", daemon=True).start()
    if done.wait(timeout):
        return True
    logger.warning("leaving the tensor-parallel group took over %.0f s (a rank is stuck in a "
                   "collective); aborting it in the background", timeout)
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:  # it can block on the stuck teardown too: never wait for it
        threading.Thread(target=_quietly, args=(abort,), name="asyncinfer-abort-group",
                         daemon=True).start()
    return False


def _quietly(call: Callable[[], object]) -> None:
    try:
        call()
    except Exception:
        logger.debug("%s failed", call, exc_info=True)


def _refuse_reentry() -> None:
    """In a process still importing its parent's main script (spawn re-runs it as
    ``__mp_main__``), starting ranks is that script lacking its main guard: a rank of ours
    exits with REENTERED for its parent to say so; another process gets the EngineError."""
    if not getattr(multiprocessing.current_process(), "_inheriting", False):
        return
    if multiprocessing.current_process().name.startswith(RANK_NAME):
        os._exit(REENTERED)
    raise EngineError(_no_main_guard())


def _no_main_guard() -> str:
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    return NO_MAIN_GUARD.format(script=f"the script {script}" if script else "the main script")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, size: int, port: int, backend: str, leader: int,
               entry: Callable[..., None], args: tuple[Any, ...]) -> None:
    """A rank's process: join the group, run ``entry``; exit 1, the reason logged, if it
    fails or rank 0's process exits."""
    watch_peers_in_this_process()
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s [tp{rank}] %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(target=_watch_leader, args=(rank, leader), daemon=True,
                     name="asyncinfer-tp-leader").start()
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    try:
        entry(rank, *args)
    except Exception as exc:
        logger.error("tensor-parallel rank %d stops: %s", rank, exc)
        os._exit(1)  # a collective of another thread may still wait: do not join it
    leave_group()  # if entry has not left it already
    _exit_now(0)


def _exit_now(code: int) -> None:
    """End a rank whose work is done without the interpreter's teardown: the collectives'
    C++ threads (gloo's, the store's) are not all joined by then, and a destructor that finds
    one running aborts the process (SIGABRT) after a clean stop."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _watch_leader(rank: int, leader: int) -> None:
    while not has_exited(leader):
        time.sleep(0.5)
    logger.error("tensor-parallel rank 0 (pid %d) exited; rank %d stops", leader, rank)
    os._exit(1)
