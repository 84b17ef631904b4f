"""One server: the engine core in one process, the HTTP front in ``--api-workers``.

See docs/architecture.md, "Server processes and stopping".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from aiohttp import web

from asyncinfer.errors import ConfigError, EngineError
from asyncinfer.ipc.messages import Addresses, CoreInfo
from asyncinfer.logs import configure_logging
from asyncinfer.options import engine_options
from asyncinfer.processes import describe_exit, new_event_loop, watch_exit
from asyncinfer.server.options import ServerOptions

if TYPE_CHECKING:
    from multiprocessing.context import SpawnProcess

    from asyncinfer.server.starting import Starting
    from asyncinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["app_runner", "new_event_loop", "serve"]

CORE_START_TIMEOUT = 1800.0   # loading and capturing a large model takes a while
CORE_STOP_TIMEOUT = 30.0


# The signals that stop a server (a terminal's hang-up as SIGTERM); a front process other
# than the server's own ignores SIGHUP: the server process decides, and stops it.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
FRONT_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """``signals`` caught from a process's first moment: one that comes before the event loop
    watches for them is kept in :attr:`received` instead of killing the process (SIGTERM,
    SIGHUP) or raising at a random point (SIGINT)."""

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS) -> None:
        self.received: list[int] = []
        self.signals = signals
        self.install()

    def install(self) -> None:
        """Catch them here (again after an event loop that watched them closes)."""
        for sig in self.signals:
            signal.signal(sig, self._keep)

    def _keep(self, signum: int, _frame: object) -> None:
        self.received.append(signum)


class _Stopped(Exception):
    """A stop signal came while the engine core was starting."""


class _QuietMalformed(logging.Filter):
    """Keep what is not HTTP/1.1 (a router probing for HTTP/2 or gRPC, a scanner) out of the
    error log: aiohttp answers it 400 and logs a traceback; here it is one debug line."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import BadHttpMessage

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BadHttpMessage):
            logger.debug("malformed HTTP request answered 400: %s", exc.message)
            return False
        return True


_QUIET = _QuietMalformed()


def app_runner(app: web.Application, header_timeout: float) -> web.AppRunner:
    """The runner ``serve`` uses: a client that disconnects has its handler cancelled (so its
    request is aborted at once), and a connection that sends no complete request head within
    ``header_timeout`` seconds, or idles that long between requests, is closed. After an
    error answered before its body was read (408, 413), the connection lingers at most 2 s
    for the rest of the body. At exit, after the drain, handlers get 5 s more. A request
    that is not HTTP/1.1 is answered 400 without a traceback in the log."""
    logging.getLogger("aiohttp.server").addFilter(_QUIET)
    return web.AppRunner(app, handler_cancellation=True, keepalive_timeout=header_timeout,
                         lingering_time=2.0, shutdown_timeout=5.0)


def serve(args: argparse.Namespace) -> int:
    """Serve one replica on ``args.host:args.port`` until SIGTERM, SIGINT or SIGHUP (then
    0), or until a process of the server dies (then 1); ``--dp`` is :mod:`.cli`'s to
    dispatch. From the moment the port is bound it answers: 503 naming the step until
    the engine is ready."""
    options = ServerOptions.from_args(args)  # a wrong flag fails before the core loads
    signals = StopSignals()
    listener = listen(options.host, options.port)
    directory = tempfile.mkdtemp(prefix="asyncinfer-")
    processes: list[SpawnProcess] = []  # the core, then fronts 1 .. N-1
    loop = new_event_loop()
    try:
        return loop.run_until_complete(_serve(args, options, listener, Addresses(directory),
                                              signals, processes))
    finally:
        loop.close()
        signals.install()  # closing gave them back their default actions
        listener.close()
        for front in processes[1:]:
            _reap(front, args.shutdown_delay + args.shutdown_timeout + 15)
        if processes:
            _reap(processes[0], CORE_STOP_TIMEOUT)
        shutil.rmtree(directory, ignore_errors=True)


async def _serve(args: argparse.Namespace, options: ServerOptions, listener: socket.socket,
                 addresses: Addresses, signals: StopSignals,
                 processes: list[SpawnProcess]) -> int:
    """Answer "starting" on ``listener`` while the core loads, then serve as front 0."""
    from asyncinfer.server.starting import Starting

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in signals.signals:
        loop.add_signal_handler(sig, stop.set)
    if signals.received:
        stop.set()
    starting = Starting("starting the engine core")
    await starting.open(listener, args.header_timeout)
    try:
        info = await _start_core(args, options, addresses, starting, stop, processes)
        if info is None:
            logger.info("stopped while the engine core was starting")
            return 0
        spawn = multiprocessing.get_context("spawn")
        workers = options.api_workers

        def spawn_fronts() -> list[SpawnProcess]:
            for index in range(1, workers):
                front = spawn.Process(target=_front_process, name=f"asyncinfer-front-{index}",
                                      args=(args, info, addresses, index, workers, listener,
                                            bool(getattr(args, "verbose", False)),
                                            os.getpid()))
                front.start()
                processes.append(front)
            return processes[1:]

        return await _front(args, info, addresses, 0, workers, listener, signals,
                            spawn_children=spawn_fronts, core=processes[0],
                            starting=starting, stop=stop)
    finally:
        await starting.close()


async def _start_core(args: argparse.Namespace, options: ServerOptions,
                      addresses: Addresses, starting: Starting, stop: asyncio.Event,
                      processes: list[SpawnProcess]) -> CoreInfo | None:
    """Start the engine core (appended to ``processes``), its steps on ``starting``; its
    CoreInfo, or None where ``stop`` was set first (the core then stopped)."""
    from asyncinfer.ipc.core_process import run_engine_core

    # Started from this thread: a child started by a worker thread would be that thread's.
    spawn = multiprocessing.get_context("spawn")
    receive, send = spawn.Pipe(duplex=False)
    core = spawn.Process(target=run_engine_core, name="asyncinfer-core",
                         args=(engine_options(args), addresses, options.api_workers, send,
                               bool(getattr(args, "verbose", False))))
    core.start()
    send.close()
    stopping = threading.Event()
    loading: asyncio.Future[Any] = asyncio.ensure_future(
        asyncio.get_running_loop().run_in_executor(
            None, _wait_core, core, receive, stopping, starting.set_step, processes))
    halted: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([loading, halted], return_when=asyncio.FIRST_COMPLETED)
    finally:
        halted.cancel()
    if stop.is_set():
        stopping.set()
    try:
        return await loading
    except _Stopped:
        return None


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` that every front accepts on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} (--host, --port): "
                          f"{exc.strerror}") from None
    # A burst of clients must not overflow the accept queue (aiohttp's default is 128).
    sock.listen(4096)
    sock.setblocking(False)
    return sock


def _wait_core(core: SpawnProcess, receive: multiprocessing.connection.Connection,
               stopping: threading.Event, on_step: Callable[[str], None],
               processes: list[SpawnProcess]) -> CoreInfo:
    """Wait for the engine core's CoreInfo (or the error it failed with) on ``receive``,
    each step it reports to ``on_step``; raise :class:`_Stopped`, the core stopped, once
    ``stopping`` is set."""
    from asyncinfer.ipc.messages import Step

    answer: Any = None
    try:
        deadline = time.monotonic() + CORE_START_TIMEOUT
        while answer is None or isinstance(answer, Step):
            if isinstance(answer, Step):
                on_step(answer.text)
            answer = None
            if stopping.is_set():
                core.terminate()
                raise _Stopped
            if time.monotonic() > deadline:
                raise EngineError(f"the engine core did not start within "
                                  f"{CORE_START_TIMEOUT:g} s")
            ready = multiprocessing.connection.wait([receive, core.sentinel], 0.1)
            if receive in ready or (ready and receive.poll()):
                try:
                    answer = receive.recv()
                except EOFError:
                    core.join(5.0)
                    raise EngineError(f"the engine core {describe_exit(core.exitcode)} "
                                      "while starting") from None
            elif ready:
                core.join(1.0)
                raise EngineError(f"the engine core {describe_exit(core.exitcode)} while "
                                  "starting")
    except BaseException:
        _reap(core, 5.0)
        raise
    finally:
        receive.close()
    if isinstance(answer, str):
        core.join(10.0)
        raise ConfigError(answer)
    processes.append(core)
    return cast(CoreInfo, answer)


def _reap(process: Any, timeout: float) -> None:
    """Wait for a child to exit; terminate, then kill, one that does not."""
    process.join(timeout)
    if process.is_alive():
        logger.warning("%s (pid %d) did not stop; terminating it", process.name, process.pid)
        process.terminate()
        process.join(5.0)
    if process.is_alive():
        process.kill()
        process.join()


def _front_process(args: argparse.Namespace, info: CoreInfo, addresses: Addresses,
                   index: int, workers: int, listener: socket.socket, verbose: bool,
                   parent: int) -> None:
    """The entry of fronts 1 .. N-1, started by the server process ``parent`` (named by
    it: where it died before this process ran, ``os.getppid()`` would be init's)."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signals = StopSignals(FRONT_STOP_SIGNALS)
    configure_logging(verbose, f"front {index}")
    loop = new_event_loop()
    try:
        code = loop.run_until_complete(_front(args, info, addresses, index, workers, listener,
                                              signals, parent=parent))
    finally:
        loop.close()
    raise SystemExit(code)


async def _front(args: argparse.Namespace, info: CoreInfo, addresses: Addresses, index: int,
                 workers: int, listener: socket.socket, signals: StopSignals, *,
                 parent: int | None = None,
                 spawn_children: Callable[[], list[SpawnProcess]] | None = None,
                 core: SpawnProcess | None = None, starting: Starting | None = None,
                 stop: asyncio.Event | None = None) -> int:
    """Serve HTTP on ``listener`` for the core until stopped (at once where ``signals``
    kept one from before the loop watched them, or ``stop`` is set); the exit code.
    ``starting`` answers on the port until this front's app takes over; then
    ``spawn_children`` starts the other fronts, so that no front answers ready while
    ``starting`` still refuses on the same port."""
    from asyncinfer.ipc.client import EngineClient
    from asyncinfer.server.app import create_app
    from asyncinfer.server.operations import STATE, drain, unready
    from asyncinfer.server.router_api import WorkerInfo

    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    failure: list[str] = []

    def fail(why: Callable[[], str]) -> Callable[[], None]:
        def stop_failing() -> None:
            if not failure:
                failure.append(why())
                logger.error("%s; stopping", failure[0])
            stop.set()
        return stop_failing

    for sig in signals.signals:
        loop.add_signal_handler(sig, stop.set)
    if signals.received:
        stop.set()
    unwatch: list[Callable[[], None]] = []
    if parent is not None:  # from the start: the server may die while this one starts
        unwatch.append(watch_exit(parent, fail(lambda: f"the server process {parent} is gone")))
    if starting is not None:
        starting.set_step("loading the tokenizer")
    tokenizer = await loop.run_in_executor(None, _load_tokenizer, info.model_dir)
    client = EngineClient(info, addresses, index, workers, tokenizer)
    await client.start()
    client.on_core_exit(fail(lambda: f"the engine core (pid {info.pid}) "
                                     f"{_exit_of(core)}"))
    children: list[SpawnProcess] = []
    runner: web.AppRunner | None = None
    try:
        worker = WorkerInfo.from_model_dir(info.model_dir, info.tp_size, info.policy,
                                           info.page_size, device=info.device or None,
                                           dtype=info.dtype or None)
        app = create_app(client, api_key=args.api_key,
                         served_model_name=args.served_model_name,
                         options=ServerOptions.from_args(args), worker=worker)
        runner = app_runner(app, args.header_timeout)
        await runner.setup()
        if starting is not None:  # meanwhile new connections wait in the listen queue
            await starting.close()
        await web.SockSite(runner, listener).start()
        # No await between serving and spawning: this front answers nothing before the
        # others exist.
        for child in spawn_children() if spawn_children is not None else []:
            children.append(child)
            unwatch.append(watch_exit(_pid(child), _front_exit(child, stop, fail)))
        if index == 0:
            url = http_url(args.host, listener.getsockname()[1])
            replica = getattr(args, "replica", None)
            if replica is None:
                logger.info("%s", banner(info, url, args.served_model_name, workers))
            else:  # the launcher's banner names every replica
                logger.info("replica %d ready on %s", replica, url)
        await stop.wait()
        for child in children:  # they drain at the same time as this one
            with contextlib.suppress(ProcessLookupError):
                os.kill(_pid(child), signal.SIGTERM)
        if failure:
            # Open requests have their answer already (503); let it reach the clients.
            await drain(app, 0.5, grace=0.5)
        else:
            await unready(app, args.shutdown_delay)
            in_flight = app[STATE].in_flight
            if in_flight:
                logger.info("shutting down: draining %d requests in flight for up to %g s",
                            in_flight, args.shutdown_timeout)
            else:
                logger.info("shutting down: nothing in flight, stopping now")
            await drain(app, args.shutdown_timeout)
            for child in children:
                await loop.run_in_executor(None, child.join,
                                           args.shutdown_delay + args.shutdown_timeout + 15)
    finally:
        for stop_watching in unwatch:
            stop_watching()
        if runner is not None:
            await runner.cleanup()
        if core is not None:  # the server process: the core stops after every front
            client.shutdown_core()
        await client.close()
    return 1 if failure else 0


def _load_tokenizer(model_dir: str) -> Tokenizer:
    """The model's tokenizer, built whole before the front answers ready (its encoders at
    the first request instead would hold up every request of a first burst), and the heap
    the loading freed handed back: about 25 MB of a front's resident memory."""
    from asyncinfer.memory import return_free_heap
    from asyncinfer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(model_dir).warm()
    return_free_heap()
    return tokenizer


def http_url(host: str, port: int) -> str:
    """The URL of a server listening on ``host:port`` (an IPv6 host in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def banner(info: CoreInfo, url: str, served_name: str | None = None,
           workers: int = 1) -> str:
    """What a server says once it is ready: the model, where it runs and how (device,
    dtype, attention, policy, tensor and data parallelism), its KV cache in pages and
    tokens, and where to reach it."""
    name = served_name or info.model_name
    served = "" if name == info.model_name else f", served as {name!r}"
    runs = ", ".join(x for x in (info.device, info.dtype,
                                 f"{info.attention} attention" if info.attention else "",
                                 f"{info.cpu_threads} CPU threads (--cpu-threads to change)"
                                 if info.cpu_threads else "") if x)
    tokens = info.kv_pages_total * info.page_size
    fronts = f", {workers} HTTP front processes" if workers > 1 else ""
    return "\n".join([
        f"serving {name} on {url} (Ctrl-C to stop)",
        f"  model     {info.model_name}{served}, from {info.model_dir}",
        f"  device    {runs}",
        f"  policy    {info.policy}",
        f"  parallel  tp {info.tp_size}, dp 1{fronts}",
        f"  KV cache  {info.kv_pages_total} pages of {info.page_size} tokens = {tokens} "
        f"tokens; context {info.context_len} tokens (--kv-cache-gb or --num-pages to "
        "change)",
        f"  API       {url}/v1 (OpenAI: /v1/completions, /v1/chat/completions), "
        f"{url}/health, {url}/metrics",
    ])


def _pid(process: SpawnProcess) -> int:
    assert process.pid is not None, "not started"
    return process.pid


def _front_exit(child: SpawnProcess, stop: asyncio.Event,
                fail: Callable[[Callable[[], str]], Callable[[], None]]) -> Callable[[], None]:
    """What the server process does when front ``child`` exits: stop, unless it is
    stopping already (then fronts exit by design)."""
    def why() -> str:
        return f"{child.name} (pid {child.pid}) {_exit_of(child)}"

    died = fail(why)
    return lambda: None if stop.is_set() else died()


def _exit_of(process: SpawnProcess | None) -> str:
    """How a process ended, in words ("exited" where this process is not its parent)."""
    if process is None:
        return "exited"
    process.join(1.0)  # a child that has exited: reap it and read its code
    return describe_exit(process.exitcode)
