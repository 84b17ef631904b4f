"""Replicas in separate processes with different hash seeds and object layouts, fed the same
message log, produce identical batch sequences: uids, order, chunk sizes and KV slots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncinfer.policies.registry import available_policies
from tests.rank_replica import CACHE_TYPES

ROOT = Path(__file__).resolve().parent.parent
# vtc (a plugin, when installed) keeps state across views: the contract is per sequence.
POLICIES = ["prefill_first", "decode_first", "skip_ahead", "priority", "lpm",
            "stall_free"] + (
    ["vtc"] if "vtc" in available_policies() else [])
CASES = [f"{policy}/{cache}" for policy in POLICIES for cache in CACHE_TYPES]


@pytest.fixture(scope="module")
def replicas() -> tuple[dict[str, Any], dict[str, Any]]:
    """Two replicas of every case, run at once: hash seeds 0 and 4242, different ballast."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.rank_replica", ballast, *POLICIES],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": path})
             for seed, ballast in (("0", "0"), ("4242", "10007"))]
    outs = [proc.communicate()[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    return json.loads(outs[0]), json.loads(outs[1])


@pytest.mark.parametrize("case", CASES)
def test_replicas_schedule_identical_batches(
        replicas: tuple[dict[str, Any], dict[str, Any]], case: str) -> None:
    first, second = replicas[0][case], replicas[1][case]
    assert len(first) > 50
    assert any(len(b["uids"]) > 1 for b in first)
    assert first == second
