"""Event loops, and watching another process from one without polling where Linux allows."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop when uvloop is installed, else asyncio's default."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def watch_exit(pid: int, callback: Callable[[], None]) -> Callable[[], None]:
    """Call ``callback`` on the running loop once process ``pid`` has exited (a pidfd, else
    polled every 0.2 s); returns a function that stops watching."""
    loop = asyncio.get_running_loop()
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        handle = loop.call_soon(callback)
        return handle.cancel
    except (AttributeError, OSError):
        return _poll(loop, pid, callback)

    def exited() -> None:
        stop()
        callback()

    def stop() -> None:
        with contextlib.suppress(Exception):
            loop.remove_reader(fd)
        with contextlib.suppress(OSError):
            os.close(fd)

    loop.add_reader(fd, exited)
    return stop


def _poll(loop: asyncio.AbstractEventLoop, pid: int,
          callback: Callable[[], None]) -> Callable[[], None]:
    def check() -> None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            callback()
            return
        except PermissionError:
            pass
        state[0] = loop.call_later(0.2, check)

    state = [loop.call_later(0.2, check)]
    return lambda: state[0].cancel()


def describe_exit(code: int | None) -> str:
    """A process's exit code (``multiprocessing``'s: negative for a signal) in words."""
    if code is None:
        return "exited"
    if code < 0:
        import signal

        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def has_exited(pid: int) -> bool:
    """Whether process ``pid`` has exited (a child not yet reaped counts as exited)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except (AttributeError, OSError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False
    try:
        import select

        return bool(select.select([fd], [], [], 0)[0])
    finally:
        os.close(fd)


def die_with_parent(sig: int) -> None:
    """Have the kernel send this process ``sig`` when its parent exits (Linux; elsewhere
    nothing), and send it now if the parent is already gone."""
    import ctypes
    import ctypes.util
    import signal

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent or parent == 1:
        signal.raise_signal(sig)
