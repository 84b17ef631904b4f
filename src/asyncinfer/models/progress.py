"""A long start-up step's report: a bar on a terminal, plain lines in a pipe or a log."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any, TypeVar

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_listeners: list[Callable[[str], None]] = []
HEARTBEAT = 10.0  # seconds of a step without a line before it says it is still at it


def format_size(nbytes: float) -> str:
    """Bytes in KiB, MiB or GiB, with a decimal where a whole number would say too little."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.{0 if nbytes >= 10 * 2**20 else 1}f} MiB"
    return f"{nbytes / 2**10:.0f} KiB"


def on_step(listener: Callable[[str], None]) -> Callable[[], None]:
    """Have ``listener`` called with every step and progress line from now on (the engine
    core passes them to the server, whose /health names the step while it starts);
    returns a function that stops it."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener)


def _tell(text: str) -> None:
    for listener in _listeners:
        with contextlib.suppress(Exception):
            listener(text)


def say(message: str, *args: object) -> None:
    """Log a start-up step at INFO; with no logging set up at all (a script calling
    ``LLM()``), print it to stderr, so a first run's fetch never passes in silence."""
    _tell(message % args if args else message)
    if logging.getLogger().hasHandlers():
        logger.info(message, *args)
    else:
        print("asyncinfer: " + (message % args if args else message), file=sys.stderr,
              flush=True)


@contextlib.contextmanager
def step(message: str, *args: object, every: float = HEARTBEAT) -> Iterator[None]:
    """Say a step, then every ``every`` s while it lasts that it still is at it."""
    say(message, *args)
    text = message % args if args else message
    start = time.monotonic()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(every):
            say("%s: still at it (%.0f s)", text, time.monotonic() - start)

    beating = threading.Thread(target=beat, name="asyncinfer-step", daemon=True)
    beating.start()
    try:
        yield
    finally:
        done.set()


class Progress:
    """One step's progress in ``unit`` ("B": bytes): a tqdm bar on a terminal (if ``bar``),
    else a line every ``every`` s and at the end; silent with this logger above INFO."""

    def __init__(self, what: str, total: float | None = None, *, unit: str = "B",
                 every: float = 5.0, bar: bool = True) -> None:
        self.what, self.total, self.unit, self.every = what, total, unit, every
        self.done = 0.0
        self.start = self._last = self._told = time.monotonic()
        self._closed = threading.Event()
        self._shown = (logger.isEnabledFor(logging.INFO)
                       or not logging.getLogger().hasHandlers())
        self._bar: Any = None
        if bar and self._shown and _is_terminal(sys.stderr):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=what, unit=unit, unit_scale=unit == "B",
                             unit_divisor=1024, file=sys.stderr, dynamic_ncols=True)
        elif self._shown:
            say("%s%s", what, f" ({self._show(total)})" if total else "")
        else:
            _tell(what)
        if self._shown:  # a line (a refreshed bar) at least every ``every`` s
            threading.Thread(target=Progress._beat, args=(weakref.ref(self), self._closed,
                                                          every),
                             name="asyncinfer-progress", daemon=True).start()

    @staticmethod
    def _beat(ref: weakref.ref[Progress], closed: threading.Event, every: float) -> None:
        """Until closed, or dropped unclosed (an error mid-step): then it says nothing."""
        while not closed.wait(every):
            self = ref()
            if self is None:
                return
            if time.monotonic() - self._last >= every:
                self._last = time.monotonic()
                if self._bar is not None:
                    self._bar.refresh()  # its elapsed time moves on
                    _tell(f"{self.what}: {self._amount()}")
                else:
                    say("%s: %s so far (%.0f s)", self.what, self._amount(),
                        self._last - self.start)
            del self

    def set_total(self, total: float) -> None:
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def update(self, amount: float) -> None:
        """``amount`` more is done."""
        self.done += amount
        now = time.monotonic()
        if now - self._told >= 1.0:  # the server's /health: once a second at most
            self._told = now
            _tell(f"{self.what}: {self._amount()}")
        if self._bar is not None:
            self._bar.update(amount)
            self._last = now
            return
        if self._shown and now - self._last >= self.every:
            self._last = now
            say("%s: %s", self.what, self._amount())

    def close(self, outcome: str = "done") -> float:
        """End the report with ``outcome`` and the seconds it took; returns the seconds."""
        seconds = time.monotonic() - self.start
        self._closed.set()
        if self._bar is not None:
            self._bar.close()
        if self._shown:
            say("%s: %s (%s in %.1f s)", self.what, outcome, self._amount(final=True),
                seconds)
        return seconds

    def iterate(self, items: Iterable[_T], size: Any = None) -> Iterator[_T]:
        """``items``, each counted done (``size(item)``, else 1) once taken; then closed."""
        for item in items:
            yield item
            self.update(size(item) if size is not None else 1)
        self.close()

    def _show(self, amount: float) -> str:
        return format_size(amount) if self.unit == "B" else f"{amount:.0f} {self.unit}"

    def _amount(self, final: bool = False) -> str:
        if final or not self.total:
            return self._show(self.done)
        return (f"{self._show(self.done)} of {self._show(self.total)} "
                f"({100 * self.done / self.total:.0f}%)")


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
