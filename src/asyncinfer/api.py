"""The public surface: ``LLM`` for offline batches, ``SamplingParams``, ``RequestOutput``."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from attrs import define, field, frozen

from asyncinfer.config import EngineConfig
from asyncinfer.engine.runner import ModelRunner
from asyncinfer.errors import InvalidRequestError
from asyncinfer.models.source import resolve_model
from asyncinfer.params import SamplingParams
from asyncinfer.policies.base import Policy
from asyncinfer.policies.registry import load_policy
from asyncinfer.scheduler.request import FinishReason
from asyncinfer.scheduler.scheduler import Scheduler
from asyncinfer.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["LLM", "RequestMetrics", "RequestOutput", "SamplingParams"]

Prompt = str | Sequence[int]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text or ids) or many, as a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # type: ignore[list-item]
    return items  # type: ignore[return-value]


@frozen
class RequestMetrics:
    """Wall-clock times of one request (seconds, ``time.perf_counter``)."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float


@frozen
class RequestOutput:
    """The result of one request."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    error: str | None = None
    cached_tokens: int = 0          # prompt tokens found in the prefix cache
    metrics: RequestMetrics | None = None


@define
class _Tracked:
    prompt: str | None
    prompt_ids: list[int]
    detok: IncrementalDetokenizer | None
    arrival: float
    token_ids: list[int] = field(factory=list)
    first_token: float | None = None


class LLM:
    """Offline generation over the same scheduling loop the server uses.

    ``LLM(model=None)`` runs the embedded SmolLM2-135M-Instruct. ``policy`` is a registered
    name (see ``asyncinfer policies``) or a Policy instance; the other options are those of
    :class:`~asyncinfer.config.EngineConfig`.
    """

    def __init__(self, model: str | None = None, *, policy: str | Policy = "prefill_first",
                 policy_options: Mapping[str, Any] | None = None,
                 skip_tokenizer_init: bool = False, **engine_options: Any) -> None:
        model_dir = resolve_model(model)
        self.config = EngineConfig(model=str(model_dir), **engine_options)
        self.policy = load_policy(policy, policy_options)
        # Without a tokenizer prompts must be token ids and outputs carry no text.
        self.tokenizer = None if skip_tokenizer_init else Tokenizer.from_pretrained(model_dir)
        self.runner = ModelRunner(self.config, model_dir)
        eos = (self.tokenizer.eos_token_ids if self.tokenizer is not None
               else _config_eos_ids(self.runner.model_config.hf_config))
        self.scheduler = Scheduler(self.runner, self.policy, self.config, eos)
        self._next_uid = 0

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
        tracked: dict[int, _Tracked] = {}
        order = []
        for prompt, p in zip(batch, params_list):
            uid = self._next_uid
            self._next_uid += 1
            ids = self._encode(prompt)
            detok = self.tokenizer.detokenizer(p, ids) if self.tokenizer is not None else None
            tracked[uid] = _Tracked(prompt if isinstance(prompt, str) else None, ids, detok,
                                    time.perf_counter())
            order.append(uid)
            self.scheduler.add_request(uid, ids, p)
        outputs = self._run(tracked, use_tqdm)
        return [outputs[uid] for uid in order]

    def _encode(self, prompt: Prompt) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise InvalidRequestError("text prompts need a tokenizer (skip_tokenizer_init=True)")
        return self.tokenizer.encode(prompt)

    def _run(self, tracked: dict[int, _Tracked], use_tqdm: bool) -> dict[int, RequestOutput]:
        from tqdm.auto import tqdm

        outputs: dict[int, RequestOutput] = {}
        bar = tqdm(total=len(tracked), desc="generate", unit="req", disable=not use_tqdm)
        with torch.inference_mode():
            while len(outputs) < len(tracked):
                for event in self.scheduler.step():
                    t = tracked[event.uid]  # every uid in flight was added by this call
                    reason = event.finish_reason
                    detok = t.detok
                    stopped = detok is not None and detok.stopped
                    if event.token is not None and not stopped:
                        t.token_ids.append(event.token)
                        t.first_token = t.first_token or time.perf_counter()
                        if detok is not None:
                            detok.push([event.token])
                            if detok.stopped and reason is None:  # a stop string matched
                                self.scheduler.abort(event.uid, notify=False)
                                reason = "stop"
                    if reason is None or event.uid in outputs:
                        continue
                    text = ""
                    if detok is not None:
                        detok.finish()
                        text = detok.text
                        reason = "stop" if detok.stopped else reason
                    outputs[event.uid] = RequestOutput(
                        event.uid, t.prompt, t.prompt_ids, text, t.token_ids, reason,
                        event.error, event.prefix_len,
                        RequestMetrics(t.arrival, t.first_token, time.perf_counter()))
                    bar.update(1)
        bar.close()
        return outputs


def _config_eos_ids(hf_config: Any) -> frozenset[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
