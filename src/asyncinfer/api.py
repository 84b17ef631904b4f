"""The public surface: ``AsyncEngine`` (in-process, async), ``LLM`` (offline, synchronous),
``SamplingParams``, ``RequestOutput`` and ``StreamDelta``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import pickle
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import attrs

from asyncinfer.config import EngineConfig, ModelConfig
from asyncinfer.coordinator import Coordinator, RoundObserver
from asyncinfer.core import Event
from asyncinfer.distributed.launch import STOP_TIMEOUT, Ranks, backend_for, leave_group
from asyncinfer.distributed.parallel import TensorParallel
from asyncinfer.distributed.sync import RoundSync
from asyncinfer.engine import create_runner
from asyncinfer.engine.runner import ModelRunner
from asyncinfer.errors import ConfigError, InvalidRequestError
from asyncinfer.models.source import resolve_model
from asyncinfer.outputs import (
    Channel,
    EngineStats,
    Prompt,
    RequestMetrics,
    RequestOutput,
    StreamDelta,
    complete,
    stream_deltas,
)
from asyncinfer.params import SamplingParams
from asyncinfer.policies.base import Policy
from asyncinfer.policies.registry import load_policy
from asyncinfer.processes import new_event_loop
from asyncinfer.scheduler.scheduler import Scheduler
from asyncinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["LLM", "AsyncEngine", "EngineStats", "RequestMetrics", "RequestOutput",
           "SamplingParams", "StreamDelta"]


class AsyncEngine:
    """The engine in-process: ``await generate(...)`` and ``async for d in stream(...)``.

    The options are :class:`~asyncinfer.config.EngineConfig`'s, as keywords: among them
    ``policy`` (a registered name, or a Policy instance: the config then records its name),
    ``policy_options`` and ``overlap`` (schedule batch N+1 while batch N runs); plus
    ``skip_tokenizer_init``. Use ``async with AsyncEngine(...) as engine``. Cancelling a
    task that awaits a request aborts the request and frees its slot and pages.
    """

    def __init__(self, model: str | None = None, *, policy: str | Policy | None = None,
                 skip_tokenizer_init: bool = False, **engine_options: Any) -> None:
        instance = None
        if isinstance(policy, str):
            engine_options["policy"] = policy
        elif policy is not None:  # checked now, before the model loads
            instance = load_policy(policy, engine_options.get("policy_options"))
            engine_options["policy"] = instance.name
        model_dir = resolve_model(model)
        self.model_name = model_dir.name
        self.config = EngineConfig(model=str(model_dir), **engine_options)
        self.policy = instance or load_policy(self.config.policy, self.config.policy_options)
        # Without a tokenizer prompts must be token ids and outputs carry no text.
        self.tokenizer = None if skip_tokenizer_init else Tokenizer.from_pretrained(model_dir)
        # Tensor parallelism without a process group: this process is rank 0 and starts
        # the others, which load their parts of the model while this one loads its own.
        self._ranks = (_launch_ranks(self.config, model_dir, instance)
                       if _needs_ranks(self.config) else None)
        # One thread does the model's CPU work, building it included, and then every batch
        # (see _compute_thread).
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
            # Python's full collections walk every object alive; the engine's start-up
            # objects live as long as it does, so take them out of the count (vLLM does too).
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
        assert self._coordinator is not None and self._coordinator._task is not None
        try:
            await self._coordinator._task
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

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (text needs the tokenizer)."""
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise InvalidRequestError("text prompts need a tokenizer (skip_tokenizer_init=True)")
        return self.tokenizer.encode(prompt)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None
                       ) -> RequestOutput:
        """Run one request to the end."""
        coordinator = self._started()
        params = params or SamplingParams()
        ids = self.encode(prompt)
        uid = next(self._uids)
        return await complete(uid, prompt, ids, params, self.tokenizer,
                              lambda channel: coordinator.add(uid, ids, params, channel),
                              lambda: coordinator.abort(uid))

    def stream(self, prompt: Prompt, params: SamplingParams | None = None
               ) -> AsyncIterator[StreamDelta]:
        """Text deltas of one request as they are produced; the last carries the output.
        A reader that falls behind gets what came meanwhile in one delta."""
        coordinator = self._started()
        params = params or SamplingParams()
        ids = self.encode(prompt)
        uid = next(self._uids)
        return stream_deltas(uid, prompt, ids, params, self.tokenizer,
                             lambda channel: coordinator.add(uid, ids, params, channel),
                             lambda: coordinator.abort(uid))

    def submit(self, uid: int, prompt_ids: list[int], params: SamplingParams,
               channel: Channel) -> None:
        """Queue a request under a caller-chosen ``uid`` (unique among those open); its
        events go to ``channel``. The entry of fronts that detokenize themselves, such as
        the HTTP front of an engine core in another process."""
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
        task = self._coordinator._task if self._coordinator is not None else None
        if task is not None:
            await asyncio.wait([task])

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
    """The thread an engine's model work runs on: loading and packing the weights, then
    every batch.

    OpenMP gives each thread that starts parallel regions a team of workers of its own.
    Once a process has two such teams on a machine with no more cores than their threads,
    libgomp stops spinning its workers between regions, and every region (torch's ops and
    our kernels alike, dozens a layer) pays for waking them, several times the cost of a
    small kernel (docs/benchmarks.md has the measurement). Building the model on the
    thread that later runs it keeps one team.
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncinfer-compute")


class LLM:
    """Offline generation: a synchronous front of the same engine the server runs.

    ``LLM(model=None)`` runs the embedded SmolLM2-135M-Instruct. The options are those of
    :class:`AsyncEngine`: :class:`~asyncinfer.config.EngineConfig`'s (``policy`` is a
    registered name, see ``asyncinfer policies``, or a Policy instance), plus
    ``skip_tokenizer_init``.
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.engine = AsyncEngine(model, **options)
        self._loop = asyncio.new_event_loop()

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (None with ``skip_tokenizer_init``)."""
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        """The validated engine options."""
        return self.engine.config

    @property
    def policy(self) -> Policy:
        """The scheduling policy in use."""
        return self.engine.policy

    @property
    def runner(self) -> ModelRunner:
        """The model runner (model, KV pool, token pool)."""
        return self.engine.runner

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler (tests and traces look inside)."""
        return self.engine.scheduler

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        batch = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params_list = [params] * len(batch) if isinstance(params, SamplingParams) else list(
            params)
        if len(params_list) != len(batch):
            raise InvalidRequestError(
                f"{len(batch)} prompts but {len(params_list)} sampling params")
        return self._loop.run_until_complete(self._generate(batch, params_list, use_tqdm))

    async def _generate(self, prompts: list[Prompt], params: list[SamplingParams],
                        use_tqdm: bool) -> list[RequestOutput]:
        """Run every request at once. The bar counts finished requests against the total
        and shows the output tokens so far with their rate, as the tokens arrive (see
        :class:`_TokenMeter`): a long batch moves before its first request ends."""
        from tqdm.auto import tqdm

        await self.engine.start()
        with tqdm(total=len(prompts), desc="generate", unit="req", disable=not use_tqdm,
                  postfix=_TokenMeter.label(0, 0.0)) as bar:
            meter = _TokenMeter(bar) if use_tqdm else None

            async def one(prompt: Prompt, p: SamplingParams) -> RequestOutput:
                if meter is None:
                    out = await self.engine.generate(prompt, p)
                else:
                    out = await self._metered(prompt, p, meter)
                    meter.relabel()  # the line update() may print is current
                bar.update(1)
                return out

            outputs = await asyncio.gather(*(one(x, p) for x, p in zip(prompts, params)))
            if meter is not None:
                meter.finish(sum(len(o.token_ids) for o in outputs))
        # Requests ended by a stop string were aborted by message; let the loop apply that.
        await self.engine.wait_idle()
        return list(outputs)

    async def _metered(self, prompt: Prompt, p: SamplingParams, meter: _TokenMeter
                       ) -> RequestOutput:
        """``AsyncEngine.generate``, with the request's events counted by ``meter`` on
        their way to its channel."""
        engine = self.engine
        ids = engine.encode(prompt)
        uid = next(engine._uids)
        return await complete(uid, prompt, ids, p, engine.tokenizer,
                              lambda channel: engine.submit(uid, ids, p,
                                                            _MeteredChannel(channel, meter)),
                              lambda: engine.abort(uid))

    def close(self) -> None:
        """Stop the engine's loop (also done when the object is collected)."""
        if not self._loop.is_closed():
            self._loop.run_until_complete(self.engine.close())
            self._loop.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class _TokenMeter:
    """The output tokens of one ``LLM.generate`` call, counted as the engine delivers
    them, and shown on its progress bar (``out=N tok, R tok/s``, R averaged since the
    start) at most once per ``bar.mininterval``.

    A token costs one addition: the first token of an engine round schedules one check
    of the clock after the round's deliveries, and only a due check formats and prints.
    So a fast engine pays per round, not per token, and the terminal sees a bounded rate.
    """

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.tokens = 0
        self.start = self.shown = time.perf_counter()
        self.interval = float(bar.mininterval)
        self._checking = False
        self._loop = asyncio.get_running_loop()

    @staticmethod
    def label(tokens: int, elapsed: float) -> str:
        rate = tokens / elapsed if elapsed > 0 else 0.0
        return f"out={tokens} tok, {rate:.1f} tok/s"

    def check_soon(self) -> None:
        """Tokens arrived (counted by the channel): look at the clock once this round's
        deliveries are done."""
        self._checking = True
        self._loop.call_soon(self._check)

    def _check(self) -> None:
        self._checking = False
        now = time.perf_counter()
        if now - self.shown >= self.interval:
            self.shown = now
            self.bar.set_postfix_str(self.label(self.tokens, now - self.start))

    def relabel(self) -> None:
        """Bring the label up to date without printing (the bar prints when it is due)."""
        self.bar.set_postfix_str(
            self.label(self.tokens, time.perf_counter() - self.start), refresh=False)

    def finish(self, tokens: int) -> None:
        """The final label, from the outputs' own counts (a request that met a stop string
        may have been delivered a token or two its output dropped); closing prints it."""
        self.tokens = tokens
        self.relabel()


class _MeteredChannel:
    """A request's channel that counts its tokens on ``meter`` and passes every event on."""

    __slots__ = ("channel", "meter")

    def __init__(self, channel: Channel, meter: _TokenMeter) -> None:
        self.channel = channel
        self.meter = meter

    def put_nowait(self, event: Event) -> None:
        if event.token is not None:
            meter = self.meter
            meter.tokens += 1
            if not meter._checking:
                meter.check_soon()
        self.channel.put_nowait(event)


def _needs_ranks(config: EngineConfig) -> bool:
    """Whether this engine must start its other tensor-parallel ranks itself: it has some,
    and no process group (a launcher such as torchrun's) put them in place already."""
    if config.tensor_parallel_size == 1:
        return False
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


def _launch_ranks(config: EngineConfig, model_dir: Path, policy: Policy | None) -> Ranks:
    """Start ranks 1..N-1 of ``config``'s engine (this process becomes rank 0), once the
    split is known to fit the model."""
    model = ModelConfig.from_pretrained(model_dir)
    TensorParallel(0, config.tensor_parallel_size).check(
        model.num_heads, model.num_kv_heads, model.intermediate_size)
    options = attrs.asdict(config, recurse=False)
    options["policy_options"] = dict(config.policy_options)
    if policy is not None:  # an instance, not a registered name: each rank gets a copy
        try:
            options["policy"] = pickle.loads(pickle.dumps(policy))
        except Exception as exc:
            raise ConfigError(f"the policy {policy.name!r} must be picklable to run on "
                              f"{config.tensor_parallel_size} tensor-parallel ranks: {exc}"
                              ) from exc
        del options["policy_options"]
    return Ranks.launch(config.tensor_parallel_size, backend_for(config.device), _follow,
                        (options,))


def _follow(rank: int, options: dict[str, Any]) -> None:
    """A started rank's work: its engine (the same options, this rank's part of the model)
    following rank 0 until told to stop."""
    model = options.pop("model")
    engine = AsyncEngine(model, skip_tokenizer_init=True, **options)
    logger.info("rank %d ready", rank)
    new_event_loop().run_until_complete(engine.follow())
    # Rank 0 leaves the group as it stops, and NCCL's teardown waits for every rank: leave
    # it here too, rather than at interpreter exit.
    leave_group()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text or ids) or many, as a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # type: ignore[list-item]
    return items  # type: ignore[return-value]


def _config_eos_ids(hf_config: Any) -> frozenset[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
