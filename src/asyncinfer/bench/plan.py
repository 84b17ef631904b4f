"""The requests of an `asyncinfer bench serve` run, planned before any is sent: prompts of
random ids, output lengths, long prompts, hang-ups, tenants and priorities, each seeded."""

from __future__ import annotations

import random

from attrs import evolve, frozen

from asyncinfer.bench.traffic import LengthDist, Uniform, arrival_times

TOKEN_IDS = (100, 10000)  # as in `bench decode`: clear of special ids, inside real vocabularies
DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN = 128, 64  # of --workload uniform


@frozen
class RequestSpec:
    """One planned request. ``hangup_after``: the client closes the stream after that many
    text chunks (None: reads to the end); ``tenant``, ``priority``, ``seed``: None is not
    sent; ``temperature``, ``top_p``: its sampling (greedy by default)."""

    prompt: tuple[int, ...]
    output_len: int
    hangup_after: int | None = None
    tenant: str | None = None
    priority: int | None = None
    long: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


def arrival_schedule(num_requests: int, rate: float, seed: int,
                     burstiness: float = 1.0) -> list[float]:
    """Send times from ``random.Random(seed)`` (see ``traffic.arrival_times``)."""
    return arrival_times(num_requests, rate, random.Random(seed), burstiness)


def make_requests(num_requests: int, input_len: tuple[int, int] | LengthDist,
                  output_len: tuple[int, int] | LengthDist, seed: int, prefix_groups: int = 0,
                  prefix_len: int = 0) -> list[RequestSpec]:
    """Prompts of random ids, lengths drawn from a distribution or an inclusive uniform range.
    With ``prefix_groups``, request i's prompt starts with shared prefix ``i % prefix_groups``
    of ``prefix_len`` ids, for a prefix cache and a cache-aware router to serve."""
    inputs = Uniform(*input_len) if isinstance(input_len, tuple) else input_len
    outputs = Uniform(*output_len) if isinstance(output_len, tuple) else output_len
    rng = random.Random(f"prompts-{seed}")  # not the schedule's stream: same prompts at any rate
    prefixes = [tuple(rng.randrange(*TOKEN_IDS) for _ in range(prefix_len))
                for _ in range(prefix_groups)]
    specs = []
    for i in range(num_requests):
        prompt = tuple(rng.randrange(*TOKEN_IDS) for _ in range(inputs.sample(rng)))
        shared = prefixes[i % prefix_groups] if prefixes else ()
        specs.append(RequestSpec(shared + prompt, outputs.sample(rng)))
    return specs


def plan_long(specs: list[RequestSpec], fraction: float, factor: float, seed: int,
              max_len: int | None = None) -> list[RequestSpec]:
    """``specs`` with a seeded ``round(fraction * len(specs))`` of them given prompts ``factor``
    times as long (at most ``max_len``, never shorter): head-of-line blocking's test load."""
    rng = random.Random(f"long-{seed}")  # its own stream: same prompts and arrival times
    chosen = sorted(rng.sample(range(len(specs)), round(fraction * len(specs))))
    out = list(specs)
    for i in chosen:
        prompt = specs[i].prompt
        target = round(factor * len(prompt))
        if max_len is not None:
            target = min(target, max_len)
        extra = tuple(rng.randrange(*TOKEN_IDS) for _ in range(target - len(prompt)))
        out[i] = evolve(specs[i], prompt=prompt + extra, long=True)
    return out


def label_requests(specs: list[RequestSpec], tenants: list[str] | None = None,
                   priorities: list[int] | None = None) -> list[RequestSpec]:
    """``specs`` with request i's tenant ``tenants[i]`` and priority ``priorities[i]``
    (either left as it was where None)."""
    return [evolve(spec, tenant=spec.tenant if tenants is None else tenants[i],
                   priority=spec.priority if priorities is None else priorities[i])
            for i, spec in enumerate(specs)]


def plan_hangups(specs: list[RequestSpec], fraction: float, seed: int) -> list[RequestSpec]:
    """``specs`` with a seeded ``round(fraction * len(specs))`` of them hanging up after K text
    chunks, K uniform in ``1..max(1, output_len // 2)``: while running and holding KV pages."""
    rng = random.Random(f"hangups-{seed}")  # its own stream: same prompts and arrival times
    chosen = sorted(rng.sample(range(len(specs)), round(fraction * len(specs))))
    out = list(specs)
    for i in chosen:
        out[i] = evolve(specs[i], hangup_after=rng.randint(1, max(1, specs[i].output_len // 2)))
    return out


def shift_ids(specs: list[RequestSpec], shift: int) -> list[RequestSpec]:
    """``specs`` with every prompt id moved by ``shift`` within ``TOKEN_IDS`` (wrapping): the
    same lengths and the same shared prefixes, but no prompt a prefix cache has seen in the
    unshifted ones (for ``shift`` not a multiple of the range)."""
    lo, hi = TOKEN_IDS
    return [evolve(spec, prompt=tuple(lo + (t - lo + shift) % (hi - lo) for t in spec.prompt))
            for spec in specs]
