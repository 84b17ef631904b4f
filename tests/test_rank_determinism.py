"""Replicas in separate processes with different hash seeds and object layouts, fed the same
message log, produce identical batch sequences: uids, order, chunk sizes and KV slots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def replica(policy: str, cache_type: str, hash_seed: str, ballast: int) -> list[dict]:  # type: ignore[type-arg]
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "tests.rank_replica", policy, cache_type,
                          str(ballast)], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@pytest.mark.parametrize("policy", ["prefill_first", "decode_first", "skip_ahead", "priority"])
@pytest.mark.parametrize("cache_type", ["radix", "naive"])
def test_replicas_schedule_identical_batches(policy: str, cache_type: str) -> None:
    first = replica(policy, cache_type, hash_seed="0", ballast=0)
    second = replica(policy, cache_type, hash_seed="4242", ballast=10007)
    assert len(first) > 50
    assert any(len(b["uids"]) > 1 for b in first)
    assert first == second
