"""The CPU KV pool is sized from the model and the limits, not fixed, and holds memory only as
it fills: an idle `asyncinfer serve` of the embedded model stays under 2.25 GB."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from benchmarks.util import process_tree, rss, start_serve, stop

from asyncinfer.kvcache.pool import CPU_MEMORY_SHARE, KVPool, cpu_kv_budget

GiB = 2**30
# SmolLM2-135M in bfloat16: 30 layers x 3 KV heads x 64 dims x (K, V) x 2 bytes.
SMOLLM2_TOKEN = 2 * 30 * 3 * 64 * 2


def test_the_cpu_pool_holds_every_request_at_full_length_when_that_is_small() -> None:
    """8 requests of 512 tokens: exactly their room, whatever the machine has."""
    assert cpu_kv_budget(SMOLLM2_TOKEN, 512, 8, 64 * GiB) == SMOLLM2_TOKEN * 512 * 8
    assert cpu_kv_budget(1000, 100, 2, None) == 200_000


def test_the_cpu_pool_takes_a_share_of_the_memory_available_when_that_is_less() -> None:
    """64 requests of 8192 tokens want 11.25 GiB: 16 GiB available gives its share."""
    wanted = SMOLLM2_TOKEN * 8192 * 64
    assert wanted / GiB == 11.25
    assert cpu_kv_budget(SMOLLM2_TOKEN, 8192, 64, 16 * GiB) == int(CPU_MEMORY_SHARE * 16 * GiB)
    assert cpu_kv_budget(SMOLLM2_TOKEN, 8192, 64, None) == 2 * GiB  # nothing known


def test_the_cpu_pool_holds_one_whole_sequence_where_memory_allows() -> None:
    """A share too small for one longest sequence grows to it, within half the memory."""
    one = 4 * GiB // 8192
    assert cpu_kv_budget(one, 8192, 64, 8 * GiB) == 4 * GiB
    assert cpu_kv_budget(one, 8192, 64, 4 * GiB) == 2 * GiB


def test_a_cpu_pool_holds_memory_only_as_it_is_written() -> None:
    """A 1 GiB pool adds (almost) nothing resident, reads zeros, and grows by what is written."""
    before = rss()
    pool = KVPool(4, 2**13, 16, 8, 64, torch.bfloat16, torch.device("cpu"))  # 2 x 512 MiB
    assert pool.k.numel() * 2 + pool.v.numel() * 2 == GiB
    assert rss() - before < 64 * 2**20
    assert not pool.k[3].any() and not pool.v[0, -16:].any()  # zeroed, read or not
    pool.k[0].fill_(1.0)  # one layer's K: 128 MiB
    assert rss() - before > 100 * 2**20


@pytest.mark.slow
@pytest.mark.parametrize("fp32_compute", ["auto", "on"])  # on: as a CPU without bf16 units
def test_an_idle_server_of_the_embedded_model_holds_under_two_and_a_quarter_gb(
        smollm2_dir: Path, fp32_compute: str) -> None:
    """`asyncinfer serve` with its defaults on CPU, once /health answers 200: the resident
    memory of the server and every process below it sums to under 2.25 GB (the start-up
    forward leaves the heap a full round takes, and the pool's first pages, resident); the
    banner's KV line names the flags that size the pool."""
    server, _ = start_serve("--device", "cpu", "--cpu-fp32-compute", fp32_compute,
                            timeout=300)
    try:
        time.sleep(2.0)  # idle: whatever start-up left behind has settled
        processes = [server.pid, *process_tree(server.pid)]
        assert len(processes) >= 2  # the front and the engine core at least
        total = sum(rss(pid) for pid in processes)
        assert total < 2.25e9, f"{total / 1e9:.2f} GB over {len(processes)} processes"
    finally:
        stop(server)
    assert server.stderr is not None
    [kv] = [line for line in server.stderr.read().splitlines() if line.startswith("  KV cache")]
    assert "--kv-cache-gb" in kv and "--num-pages" in kv, kv
