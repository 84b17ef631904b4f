"""A plain driver until the scheduler exists: prefill one fixed batch, then decode it out.

It serves `asyncinfer generate` and the model tests; it is deliberately not a scheduler
(no admission, no arrivals, no preemption).
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncinfer.engine.batch import Batch
from asyncinfer.engine.runner import ModelRunner
from asyncinfer.errors import InvalidRequestError
from asyncinfer.kvcache.naive import NaiveCache
from asyncinfer.kvcache.pool import PageAllocator
from asyncinfer.params import SamplingParams


def generate_static(
    runner: ModelRunner,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    eos_token_ids: frozenset[int] = frozenset(),
    prefill_chunk: int | None = None,
) -> list[list[int]]:
    """Generated token ids per prompt (an EOS that ends a request is included).

    ``prefill_chunk`` splits every prompt into rounds of at most that many tokens, so later
    chunks attend over the KV cached by earlier ones.
    """
    n = len(prompts)
    if not 0 < n <= runner.max_rows:
        raise InvalidRequestError(f"batch of {n} prompts; this engine runs 1..{runner.max_rows}")
    cache = NaiveCache(PageAllocator(runner.num_pages), runner.page_table, runner.pool.page_size)
    limits = []
    for row, (prompt, p) in enumerate(zip(prompts, params)):
        if not 0 < len(prompt) < runner.context_len:
            raise InvalidRequestError(
                f"prompt of {len(prompt)} tokens; the context holds {runner.context_len}")
        runner.token_pool[row, : len(prompt)] = runner.token_pool.new_tensor(list(prompt))
        limits.append(len(prompt) + min(p.max_tokens, runner.context_len - len(prompt)))
    pages = sum(-(-lim // runner.pool.page_size) for lim in limits)
    if pages > runner.num_pages:
        raise InvalidRequestError(f"batch needs {pages} KV pages; the pool has {runner.num_pages}")

    outputs: list[list[int]] = [[] for _ in range(n)]
    done = [False] * n
    cached = [0] * n
    chunk = prefill_chunk or max(len(p) for p in prompts)
    while not all(cached[i] >= len(prompts[i]) for i in range(n)):
        live = [i for i in range(n) if cached[i] < len(prompts[i])]
        ends = [min(cached[i] + chunk, len(prompts[i])) for i in live]
        _run(runner, cache, live, [cached[i] for i in live], ends, params, outputs, done,
             limits, eos_token_ids, sample=[e == len(prompts[i]) for i, e in zip(live, ends)])
        for i, e in zip(live, ends):
            cached[i] = e
    while not all(done):
        live = [i for i in range(n) if not done[i]]
        starts = [len(prompts[i]) + len(outputs[i]) - 1 for i in live]
        _run(runner, cache, live, starts, [s + 1 for s in starts], params, outputs, done,
             limits, eos_token_ids, sample=[True] * len(live))
    for row in range(n):
        cache.release(row)
    return outputs


def _run(
    runner: ModelRunner, cache: NaiveCache, live: list[int], starts: list[int],
    ends: list[int], params: Sequence[SamplingParams], outputs: list[list[int]],
    done: list[bool], limits: list[int], eos: frozenset[int], sample: list[bool],
) -> None:
    for i, end in zip(live, ends):
        cache.reserve(i, end)
    batch = Batch(rows=live, starts=starts, ends=ends, params=[params[i] for i in live],
                  steps=[len(outputs[i]) for i in live], sample=sample)
    tokens = runner.forward(batch).next_tokens.tolist()
    for i, end, token, sampled in zip(live, ends, tokens, sample):
        if not sampled:
            continue
        outputs[i].append(token)
        done[i] = end + 1 >= limits[i] or (token in eos and not params[i].ignore_eos)
