"""One scheduler replica per (policy, cache type) fed a fixed message log; prints the batch
sequences they produced, as JSON keyed "policy/cache_type".

Run as a subprocess by test_rank_determinism.py: ``python -m tests.rank_replica BALLAST
POLICY...``, under different PYTHONHASHSEED values.
"""

from __future__ import annotations

import json
import random
import sys
from typing import Any

from asyncinfer.config import EngineConfig
from asyncinfer.params import SamplingParams
from asyncinfer.policies.registry import load_policy
from asyncinfer.scheduler.scheduler import Scheduler
from tests.fake_engine import EOS, FakeEngine

CACHE_TYPES = ("radix", "naive")


def message_log(seed: int) -> list[tuple[int, str, int, list[int], int]]:
    """(round, kind, uid, prompt, max_tokens): arrivals and aborts at given rounds."""
    rng = random.Random(seed)
    prefixes = [[], [3] * 9, [3] * 5 + [4] * 6]
    log = []
    for uid in range(40):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 40))]
        log.append((rng.randrange(0, 60), "add", uid, prompt, rng.randrange(1, 16)))
    for uid in rng.sample(range(40), 6):
        log.append((rng.randrange(0, 80), "abort", uid, [], 0))
    return sorted(log, key=lambda m: (m[0], m[1], m[2]))


def run(policy_name: str, cache_type: str) -> list[dict[str, Any]]:
    """The batches one replica launches for the log, with their KV slots and events."""
    engine = FakeEngine(num_pages=48, page_size=4, max_rows=6, context_len=96, eos_every=11)
    config = EngineConfig(cache_type=cache_type, max_extend_tokens=32,  # type: ignore[arg-type]
                          chunked_prefill=True)
    sched = Scheduler(engine, load_policy(policy_name), config, frozenset({EOS}))
    log = message_log(0)
    trace = []
    step = 0
    while log or sched.has_work:
        while log and log[0][0] <= step:
            _, kind, uid, prompt, max_tokens = log.pop(0)
            if kind == "add":
                # Priorities and tenants from the uid: priority and vtc use them.
                sched.add_request(uid, prompt, SamplingParams(
                    max_tokens=max_tokens, temperature=0.0, priority=(uid * 7) % 4,
                    tenant=str(uid % 3)))
            else:
                sched.abort(uid)
        before = len(engine.batches)
        events = sched.step()
        if len(engine.batches) > before:
            batch = engine.batches[-1]
            assert sched.last_scheduled is not None
            slots = [engine.page_table[r, s:e].tolist()
                     for r, s, e in zip(batch.rows, batch.starts, batch.ends)]
            trace.append({"uids": [r.uid for r in sched.last_scheduled.reqs],
                          "rows": batch.rows, "starts": batch.starts, "ends": batch.ends,
                          "slots": slots, "events": [(e.uid, e.token, e.finish_reason)
                                                     for e in events]})
        step += 1
    return trace


def main() -> None:
    # Shift object addresses and hash-dependent state between replicas.
    ballast = [object() for _ in range(int(sys.argv[1]))]
    traces = {f"{policy}/{cache}": run(policy, cache)
              for policy in sys.argv[2:] for cache in CACHE_TYPES}
    del ballast
    json.dump(traces, sys.stdout)


if __name__ == "__main__":
    main()
