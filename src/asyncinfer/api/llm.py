"""``LLM``: offline generation, a synchronous front of the same engine the server runs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from asyncinfer.api.async_engine import AsyncEngine
from asyncinfer.api.progress import MeteredFront, TokenMeter
from asyncinfer.config import EngineConfig
from asyncinfer.engine.runner import ModelRunner
from asyncinfer.errors import InvalidRequestError
from asyncinfer.outputs import Front, Prompt, RequestOutput
from asyncinfer.params import SamplingParams
from asyncinfer.policies.base import Policy
from asyncinfer.scheduler.scheduler import Scheduler
from asyncinfer.tokenizer import Tokenizer


class LLM:
    """Offline generation. ``LLM(model=None)`` runs the embedded SmolLM2-135M-Instruct; the
    options are :class:`AsyncEngine`'s."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.engine = AsyncEngine(model, **options)
        self._loop = asyncio.new_event_loop()

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (None with ``skip_tokenizer_init``)."""
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def policy(self) -> Policy:
        return self.engine.policy

    @property
    def runner(self) -> ModelRunner:
        return self.engine.runner

    @property
    def scheduler(self) -> Scheduler:
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
        """Every request at once, under a bar of finished requests and output tokens."""
        from tqdm.auto import tqdm

        await self.engine.start()
        with tqdm(total=len(prompts), desc="generate", unit="req", disable=not use_tqdm,
                  postfix=TokenMeter.label(0, 0.0)) as bar:
            meter = TokenMeter(bar) if use_tqdm else None
            front: Front = self.engine if meter is None else MeteredFront(self.engine, meter)

            async def one(prompt: Prompt, p: SamplingParams) -> RequestOutput:
                out = await front.generate(prompt, p)
                if meter is not None:
                    meter.relabel()  # the line update() may print is current
                bar.update(1)
                return out

            outputs = await asyncio.gather(*(one(x, p) for x, p in zip(prompts, params)))
            if meter is not None:
                meter.finish(sum(len(o.token_ids) for o in outputs))
        # Requests ended by a stop string were aborted by message; let the loop apply that.
        await self.engine.wait_idle()
        return list(outputs)

    def close(self, timeout: float | None = None) -> None:
        """Stop the engine's loop (also done when the object is collected); ``timeout``:
        give up waiting for the engine after that many seconds."""
        if not self._loop.is_closed():
            try:
                self._loop.run_until_complete(asyncio.wait_for(self.engine.close(), timeout))
            finally:
                self._loop.close()

    def __del__(self) -> None:
        # Collection happens wherever the last reference goes: never wait there for long.
        with contextlib.suppress(Exception):
            self.close(timeout=_COLLECTED_CLOSE_S)


_COLLECTED_CLOSE_S = 60.0
"""How long an LLM collected without close() waits for its engine to stop."""


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text or ids) or many, as a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # type: ignore[list-item]
    return items  # type: ignore[return-value]
