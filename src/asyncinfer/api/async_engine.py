"""``AsyncEngine``: the engine in-process, on the caller's event loop."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import attrs

from asyncinfer.api.ranks import launch_ranks, needs_ranks, rank_options
from asyncinfer.config import EngineConfig
from asyncinfer.coordinator import Coordinator, RoundObserver
from asyncinfer.distributed.launch import STOP_TIMEOUT, leave_group
from asyncinfer.distributed.sync import RoundSync
from asyncinfer.engine import create_runner
from asyncinfer.models.source import resolve_model
from asyncinfer.outputs import Channel, EngineStats, Front
from asyncinfer.params import SamplingParams
from asyncinfer.policies.base import Policy
from asyncinfer.policies.registry import load_policy
from asyncinfer.processes import new_event_loop
from asyncinfer.scheduler.scheduler import Scheduler
from asyncinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_DEFAULT_POLICY = str(attrs.fields(EngineConfig).policy.default)


class AsyncEngine(Front):
    """The engine in-process: ``await generate(...)``, ``async for d in stream(...)``.

    Options are :class:`~asyncinfer.config.EngineConfig`'s keywords; ``policy`` may be a
    registered name or a Policy instance. Use ``async with AsyncEngine(...) as engine``.
    """

    def __init__(self, model: str | None = None, *, policy: str | Policy | None = None,
                 skip_tokenizer_init: bool = False, **engine_options: Any) -> None:
        given = policy if isinstance(policy, Policy) else None
        # Built once, first: a bad policy option is refused before the model is fetched.
        self.policy = load_policy(_DEFAULT_POLICY if policy is None else policy,
                                  engine_options.get("policy_options"))
        engine_options["policy"] = policy if isinstance(policy, str) else self.policy.name
        model_dir = resolve_model(model)
        self.model_name = model_dir.name
        self.config = EngineConfig(model=str(model_dir), **engine_options)
        self.tokenizer = None if skip_tokenizer_init else Tokenizer.from_pretrained(model_dir)
        # Without a process group this process is rank 0 and starts the others.
        self._ranks = (launch_ranks(self.config, model_dir, given, _follow)
                       if needs_ranks(self.config) else None)
        # The model is built on the thread that runs its batches: see _compute_thread.
        self._compute: ThreadPoolExecutor | None = _compute_thread()
        try:
            build = partial(create_runner, self.config, model_dir)
            # On CUDA the current device is per thread: build where the loop's own calls
            # (and those of the code around it) see it.
            self.runner = build() if self.config.is_cuda else self._compute.submit(build).result()
        except BaseException:
            self._compute.shutdown()
            self._stop_ranks(failed=True)
            raise
        self.context_len = self.runner.context_len
        eos = (self.tokenizer.eos_token_ids if self.tokenizer is not None
               else _config_eos_ids(self.runner.model_config.hf_config))
        self.scheduler = Scheduler(self.runner, self.policy, self.config, eos)
        self.overlap = self.config.overlap
        tp = self.runner.tp
        # Every rank builds its channel here, in the same order (a collective call).
        self.sync = (RoundSync(tp.rank, tp.size, check_every=self.config.tp_guard_interval,
                               describe=self._ranks.describe if self._ranks else None)
                     if tp.size > 1 else None)
        self._coordinator: Coordinator | None = None
        self._uids = itertools.count()
        self._froze_gc = self.config.freezes_gc
        if self._froze_gc:
            # Start-up objects live as long as the engine: out of full collections' walk.
            gc.collect()
            gc.freeze()

    async def start(self) -> None:
        """Start the coordinator on the running event loop."""
        if self._coordinator is None:
            # The coordinator runs the batches on the thread that built the model, and
            # ends it when it stops (a later start gets a new one).
            compute, self._compute = self._compute or _compute_thread(), None
            self._coordinator = Coordinator(self.scheduler, self.runner.launch, self.overlap,
                                            self.runner.synchronize, self.sync,
                                            executor=compute)
            self._coordinator.start()

    async def follow(self) -> None:
        """Run as a tensor-parallel rank other than 0: apply rank 0's requests and aborts
        round by round, forming the same batches, until rank 0 stops (or the ranks
        diverge: then RankDivergedError)."""
        if self.sync is None or self.sync.leader:
            raise RuntimeError("follow() is for tensor-parallel ranks other than 0")
        await self.start()
        assert self._coordinator is not None
        try:
            await self._coordinator.join()
        finally:
            await self.close()

    async def close(self) -> None:
        """Fail what is still running, wait for the batch in flight, stop the loop.

        An engine that froze the heap (``freeze_gc``) unfreezes it, all of it: the runner
        sits in reference cycles, and frozen, its KV pool could never be collected."""
        failed = False
        if self._compute is not None:  # never started
            self._compute.shutdown()
            self._compute = None
        if self._coordinator is not None:
            failed = self._coordinator.failed
            await self._coordinator.stop()
            self._coordinator = None
        elif self.sync is not None and self.sync.leader and not self.sync.closing:
            # Never started: the other ranks wait for this one's first round; it is a stop.
            self.sync.closing = True
            with contextlib.suppress(Exception):
                self.sync.share([None])
        if self.sync is not None:
            # CUDA graphs hold the collectives they captured: free them while every rank
            # is still here, before the group is torn down.
            self.runner.release_graphs()
        self._stop_ranks(failed)
        if self._froze_gc:
            gc.unfreeze()
            self._froze_gc = False

    def _stop_ranks(self, failed: bool) -> None:
        """Wait for the ranks this engine started to exit (they were told to stop; after a
        failure, give them a moment to see it) and leave the process group."""
        ranks, self._ranks = self._ranks, None
        if ranks is None:
            return
        # Every rank leaves the group together (NCCL's teardown waits for the others),
        # then their processes exit; a rank stuck in a collective cannot hold this one.
        left = failed or leave_group()
        ranks.stop(timeout=5.0 if failed or not left else STOP_TIMEOUT)
        leave_group(timeout=5.0)  # what is left of it (after an abort, what abort left)

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def new_uid(self) -> int:
        return next(self._uids)

    def check_open(self) -> None:
        self._started()

    def submit(self, uid: int, prompt_ids: list[int], params: SamplingParams,
               channel: Channel) -> None:
        """Queue a request under ``uid`` (unique among those open); events go to ``channel``."""
        self._started().add(uid, prompt_ids, params, channel)

    def _started(self) -> Coordinator:
        if self._coordinator is None:
            raise RuntimeError("the engine is not started: use `async with AsyncEngine(...)`")
        return self._coordinator

    def abort(self, uid: int) -> None:
        """Stop a submitted request and free what it holds; it gets no more events."""
        if self._coordinator is not None:
            self._coordinator.abort(uid)

    def abort_all(self) -> None:
        """End every request waiting or running with finish_reason "abort", delivered to its
        reader at once (a stream's last delta, ``generate``'s output), and free what they hold
        at the engine's next round. For a server that stops waiting for its requests."""
        if self._coordinator is not None:
            self._coordinator.abort_all()

    @property
    def alive(self) -> bool:
        """True while the engine's loop runs: started, not closed, and not dead of an error
        (then every request gets an "error" output and new ones do too)."""
        return self._coordinator is not None and self._coordinator.alive

    async def wait_stopped(self) -> None:
        """Return once the engine's loop has ended: closed, or dead of an error (see
        ``alive``)."""
        if self._coordinator is not None:
            await self._coordinator.wait_stopped()

    async def wait_idle(self) -> None:
        """Wait until the engine has applied every message and has nothing to run."""
        if self._coordinator is not None:
            await self._coordinator.wait_idle()

    def stats(self) -> EngineStats:
        """Waiting and running requests, KV pages in use, batches run by phase."""
        if self._coordinator is None:
            return EngineStats(0, 0, 0, self.runner.num_pages, 0, 0)
        return EngineStats(**self._coordinator.stats())

    def observe_rounds(self, observer: RoundObserver | None) -> None:
        """Call ``observer`` with a ``coordinator.Round`` after every round of the engine's
        loop (None stops it): how a benchmark sees the host's and the device's share."""
        assert self._coordinator is not None, "the engine has not started"
        self._coordinator.observer = observer


def _compute_thread() -> ThreadPoolExecutor:
    """The one thread an engine's model work runs on, building the model included (one
    OpenMP team: see docs/architecture.md, "One compute thread")."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncinfer-compute")


def _follow(rank: int, options: dict[str, Any]) -> None:
    """A started rank's work: its engine (this rank's part of the model) following rank 0
    until told to stop."""
    options = rank_options(options)
    model = options.pop("model")
    engine = AsyncEngine(model, skip_tokenizer_init=True, **options)
    logger.info("rank %d ready", rank)
    new_event_loop().run_until_complete(engine.follow())
    # NCCL's teardown waits for every rank: leave here, not at interpreter exit.
    leave_group()


def _config_eos_ids(hf_config: Any) -> frozenset[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
