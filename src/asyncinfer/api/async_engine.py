"""``AsyncEngine``: the engine in-process, on the caller's event loop."""

from __future__ import annotations

import asyncio
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
from asyncinfer.core import Event
from asyncinfer.distributed.launch import STOP_TIMEOUT, leave_group
from asyncinfer.distributed.sync import RoundSync
from asyncinfer.engine import create_runner
from asyncinfer.engine.kv_publisher import KVEventPublisher, KVEventsSettings
from asyncinfer.errors import ConfigError, InvalidRequestError
from asyncinfer.kvcache.radix import RadixCache
from asyncinfer.models.source import resolve_model
from asyncinfer.outputs import CacheFlush, Channel, EngineStats, Front
from asyncinfer.params import SamplingParams
from asyncinfer.policies.base import Policy
from asyncinfer.policies.registry import load_policy
from asyncinfer.processes import new_event_loop
from asyncinfer.scheduler.scheduler import Scheduler
from asyncinfer.threads import set_compute_environment
from asyncinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT = 30.0  # seconds a grammar may take to compile before its request is refused

_DEFAULT_POLICY = str(attrs.fields(EngineConfig).policy.default)


class AsyncEngine(Front):
    """The engine in-process, ``async with AsyncEngine(...)``: EngineConfig's options as
    keywords; ``policy`` a registered name or a Policy instance."""

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
        settings = (None if self.config.kv_events is None
                    else KVEventsSettings.parse(self.config.kv_events))  # refused: now
        if settings is not None and self.config.cache_type != "radix":
            raise ConfigError("kv_events needs the radix cache (cache_type radix): the "
                              f"{self.config.cache_type} cache stores nothing to tell of")
        self.tokenizer = None if skip_tokenizer_init else Tokenizer.from_pretrained(model_dir)
        self._ranks = None
        if needs_ranks(self.config):
            set_compute_environment()  # the ranks' OpenMP loads after this; ours may have
            self._ranks = launch_ranks(self.config, model_dir, given, _follow)
        self._compute: ThreadPoolExecutor | None = _compute_thread()
        try:
            build = partial(create_runner, self.config, model_dir)
            # On CUDA the current device is per thread: build on the loop's.
            self.runner = build() if self.config.is_cuda else self._compute.submit(build).result()
        except BaseException:
            self._compute.shutdown()
            self._stop_ranks(failed=True)
            raise
        self.context_len = self.runner.context_len
        eos = (self.tokenizer.eos_token_ids if self.tokenizer is not None
               else _config_eos_ids(self.runner.model_config.hf_config))
        self.scheduler = Scheduler(self.runner, self.policy, self.config, eos)
        self.runner.sampler.eos_token_ids = eos  # min_tokens holds back what stops a request
        self.runner.grammars.stop_ids = eos      # a grammar allows these once complete
        self._grammar_thread: ThreadPoolExecutor | None = None
        self._compiling: dict[int, tuple[asyncio.Task[None], Channel]] = {}
        self.overlap = self.config.overlap
        tp = self.runner.tp
        # A collective call: every rank builds its channel here, in the same order.
        self.sync = (RoundSync(tp.rank, tp.size, check_every=self.config.tp_guard_interval,
                               describe=self._ranks.describe if self._ranks else None)
                     if tp.size > 1 else None)
        self._coordinator: Coordinator | None = None
        self._uids = itertools.count()
        # Rank 0 tells of its cache (every rank's holds the same pages).
        self.kv_publisher: KVEventPublisher | None = None
        if settings is not None and tp.rank == 0:
            prefix = self.scheduler.kv.prefix
            assert isinstance(prefix, RadixCache)
            prefix.publish_events("GPU" if self.config.is_cuda else "CPU")
            self.kv_publisher = KVEventPublisher(settings)
        self._froze_gc = self.config.freezes_gc
        if self._froze_gc:
            gc.collect()
            gc.freeze()

    async def start(self) -> None:
        """Start the coordinator on the running event loop."""
        if self._coordinator is None:
            compute, self._compute = self._compute or _compute_thread(), None
            self._coordinator = Coordinator(
                self.scheduler, self.runner.launch, self.overlap, self.runner.synchronize,
                self.sync, executor=compute,
                kv_events=None if self.kv_publisher is None else self.kv_publisher.publish)
            self._coordinator.start()

    async def follow(self) -> None:
        """Run as a tensor-parallel rank other than 0, applying rank 0's commands round by
        round until it stops (RankDivergedError if the ranks diverge)."""
        if self.sync is None or self.sync.leader:
            raise RuntimeError("follow() is for tensor-parallel ranks other than 0")
        await self.start()
        assert self._coordinator is not None
        try:
            await self._coordinator.join()
        finally:
            await self.close()

    async def close(self) -> None:
        """Fail what is still running, wait for the batch in flight, stop the loop; unfreeze
        a heap ``freeze_gc`` froze (see docs/architecture.md, "Freezing the heap")."""
        failed = False
        for uid in list(self._compiling):
            self._end_compiling(uid, "abort")
        if self._grammar_thread is not None:
            self._grammar_thread.shutdown(wait=False, cancel_futures=True)
            self._grammar_thread = None
        if self._compute is not None:  # never started
            self._compute.shutdown()
            self._compute = None
        if self._coordinator is not None:
            failed = self._coordinator.failed
            await self._coordinator.stop()
            self._coordinator = None
        elif self.sync is not None and self.sync.leader and not self.sync.closing:
            # Never started: the other ranks wait for a first round; send a stop.
            self.sync.closing = True
            with contextlib.suppress(Exception):
                self.sync.share([None])
        if self.sync is not None:
            # Graphs hold captured collectives: free them before the group goes.
            self.runner.release_graphs()
        self._stop_ranks(failed)
        if self.kv_publisher is not None:
            self.kv_publisher.close()
            self.kv_publisher = None
        if self._froze_gc:
            gc.unfreeze()
            self._froze_gc = False

    def _stop_ranks(self, failed: bool) -> None:
        """Wait for the ranks this engine started to exit, then leave the process group."""
        ranks, self._ranks = self._ranks, None
        if ranks is None:
            return
        # Ranks leave together (NCCL waits for all); a stuck rank cannot hold this one.
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
        """Queue a request under ``uid`` (unique among those open); events go to ``channel``.
        Token ids outside the model's vocabulary (``logit_bias``, ``stop_token_ids``):
        InvalidRequestError naming the field."""
        coordinator = self._started()
        self.check_params(params)
        spec = params.structured
        if spec is None or self.runner.grammars.compiled(spec):
            coordinator.add(uid, prompt_ids, params, channel)
            return
        # Its grammar compiles on a thread of its own; the request is queued after.
        if self._grammar_thread is None:
            self._grammar_thread = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="asyncinfer-grammar")
        compiling = asyncio.get_running_loop().run_in_executor(
            self._grammar_thread, self.runner.grammars.compile, spec, params.structured_field)
        task = asyncio.ensure_future(self._queue_compiled(uid, prompt_ids, params, channel,
                                                          compiling))
        self._compiling[uid] = (task, channel)

    async def _queue_compiled(self, uid: int, prompt_ids: list[int], params: SamplingParams,
                              channel: Channel, compiling: asyncio.Future[Any]) -> None:
        """Queue the request once its grammar compiled; refuse it if that failed or took
        longer than COMPILE_TIMEOUT (the compile goes on, and its result is kept)."""
        try:
            await asyncio.wait_for(asyncio.shield(compiling), COMPILE_TIMEOUT)
        except InvalidRequestError as exc:
            self._compiling.pop(uid, None)
            channel.put_nowait(Event(uid, None, "error", str(exc), error_kind="invalid"))
            return
        except TimeoutError:
            self._compiling.pop(uid, None)
            channel.put_nowait(Event(
                uid, None, "error", f"{params.structured_field} did not compile within "
                f"{COMPILE_TIMEOUT:.0f} s", error_kind="invalid"))
            return
        self._compiling.pop(uid, None)
        if self._coordinator is not None:
            self._coordinator.add(uid, prompt_ids, params, channel)

    def _end_compiling(self, uid: int, reason: str | None) -> None:
        task, channel = self._compiling.pop(uid)
        task.cancel()
        if reason is not None:
            channel.put_nowait(Event(uid, None, "abort"))

    def check_params(self, params: SamplingParams) -> None:
        """Refuse what this model cannot honour (InvalidRequestError naming the field)."""
        params.check_vocab(self.runner.model_config.vocab_size)

    def _started(self) -> Coordinator:
        if self._coordinator is None:
            raise RuntimeError("the engine is not started: use `async with AsyncEngine(...)`")
        return self._coordinator

    def abort(self, uid: int) -> None:
        """Stop a submitted request and free what it holds; it gets no more events."""
        if uid in self._compiling:
            self._end_compiling(uid, None)
            return
        if self._coordinator is not None:
            self._coordinator.abort(uid)

    def abort_all(self) -> None:
        """End every open request now with "abort"; their pages free at the next round."""
        for uid in list(self._compiling):
            self._end_compiling(uid, "abort")
        if self._coordinator is not None:
            self._coordinator.abort_all()

    async def flush_cache(self) -> CacheFlush:
        """Empty the prefix cache of every page no running request holds (they run on;
        what they hold stays cached)."""
        return await self._started().flush_cache()

    @property
    def alive(self) -> bool:
        """The loop runs: started, not closed, not dead of an error."""
        return self._coordinator is not None and self._coordinator.alive

    async def wait_stopped(self) -> None:
        """Return once the loop has ended: closed, or dead of an error."""
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
        publisher = self.kv_publisher
        events = {} if publisher is None else {"kv_event_batches": publisher.published,
                                               "kv_event_batches_dropped": publisher.dropped}
        return EngineStats(**self._coordinator.stats(), **events)

    def observe_rounds(self, observer: RoundObserver | None) -> None:
        """Call ``observer`` with a ``coordinator.Round`` after every round (None stops)."""
        assert self._coordinator is not None, "the engine has not started"
        self._coordinator.observer = observer


def _compute_thread() -> ThreadPoolExecutor:
    """The one thread for the model's work, its building included: see
    docs/architecture.md, "One compute thread"."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncinfer-compute")


def _follow(rank: int, options: dict[str, Any]) -> None:
    """A started rank's work: its engine following rank 0 until told to stop."""
    options = rank_options(options)
    model = options.pop("model")
    engine = AsyncEngine(model, skip_tokenizer_init=True, **options)
    logger.info("rank %d ready", rank)
    new_event_loop().run_until_complete(engine.follow())
    leave_group()


def _config_eos_ids(hf_config: Any) -> frozenset[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
