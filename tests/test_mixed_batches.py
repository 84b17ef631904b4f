"""Mixed batches end to end: stall_free through LLM (and CUDA graphs on the CPU with the
flashinfer stand-in) and through the server, token-exact with transformers in float32, and
with the tokens of the unmixed prefill_first."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest

from asyncinfer.api import LLM
from asyncinfer.params import SamplingParams
from asyncinfer.scheduler.scheduler import ScheduledBatch
from tests.hf_reference import hf_greedy, load_hf
from tests.test_flashinfer_runner import fake_fi, fi_llm  # noqa: F401  (a fixture)
from tests.test_llm import cases, greedy, tiny_llm


def record_phases(llm: LLM) -> list[ScheduledBatch]:
    """Every batch the engine's scheduler launches from now on."""
    sched, launched = llm.scheduler, []
    schedule = sched.schedule

    def recording() -> ScheduledBatch | None:
        scheduled = schedule()
        if scheduled is not None:
            launched.append(scheduled)
        return scheduled

    sched.schedule = recording  # type: ignore[method-assign]
    return launched


@pytest.mark.parametrize("budget", [None, 10], ids=["engine_budget", "budget10"])
@pytest.mark.parametrize("cache_type", ["naive", "radix"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_stall_free_is_token_exact_with_transformers(tiny_llama_dir: Path, budget: int | None,
                                                     cache_type: str, chunked: bool) -> None:
    """Sixteen prompts over four rows: every decode beside a prefill runs in a mixed batch,
    and the tokens are transformers' (so prefill_first's, which the same test holds)."""
    prompts, max_tokens, expected = cases(tiny_llama_dir)
    options = {} if budget is None else {"token_budget": budget}
    llm = tiny_llm(tiny_llama_dir, policy="stall_free", policy_options=options,
                   cache_type=cache_type, chunked_prefill=chunked,
                   max_extend_tokens=24 if chunked else 128)
    launched = record_phases(llm)
    outputs = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
    phases = [b.phase for b in launched]
    # Whole prompts longer than the budget's rest wait until nothing runs (then prefill).
    assert ("mixed" in phases) == (chunked or budget is None) and "prefill" in phases
    limit = min(budget or 10**9, 24 if chunked else 128)
    for b in launched:
        if b.phase == "mixed":
            decoded = sum(1 for n, s in zip(b.batch.extend_lens, b.batch.sample) if s and n == 1)
            assert b.batch.num_tokens <= max(limit, decoded)
    assert llm.engine.stats().batches_mixed == phases.count("mixed")
    sched = llm.scheduler
    assert not sched.has_work
    assert sched.kv.allocator.num_free + sched.kv.cached_pages == llm.runner.num_pages


def test_a_mixed_batchs_decoding_rows_take_the_cpu_decode_kernel(tiny_llama_dir: Path) -> None:
    """On a CPU with the compiled kernels (no AMX prefill), the decoding rows leading a mixed
    batch are attended by the decode kernel in place, the prefill rows request by request;
    the tokens stay transformers'."""
    prompts, max_tokens, expected = cases(tiny_llama_dir)
    llm = tiny_llm(tiny_llama_dir, policy="stall_free", chunked_prefill=True,
                   max_extend_tokens=24)
    backend = llm.runner.backend
    if backend.native is None or backend.native_prefill:
        pytest.skip("needs the CPU decode kernel without the AMX prefill kernel")
    planned: list[tuple[list[int], Any]] = []
    plan = backend.plan

    def recording(batch: Any, out_loc: Any) -> Any:
        meta = plan(batch, out_loc)
        planned.append((list(batch.extend_lens), meta))
        return meta

    backend.plan = recording
    outputs = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
    mixed = [(lens, meta) for lens, meta in planned
             if lens[0] == 1 and any(n > 1 for n in lens)]
    assert mixed, "no mixed batch was planned"
    for lens, meta in mixed:
        head = next(i for i, n in enumerate(lens) if n != 1)
        assert meta.native is not None and meta.native.table.shape[0] == head
        assert len(meta.kv_slots) == len(lens) - head


@pytest.mark.usefixtures("fake_fi")
def test_mixed_batches_replay_the_prefill_graphs(tiny_llama_dir: Path) -> None:
    """With CUDA graphs (replayed eagerly on the CPU, same padded buffers), mixed batches take
    the prefill graphs' path and give transformers' tokens."""
    prompts, max_tokens, expected = cases(tiny_llama_dir)
    llm = fi_llm(tiny_llama_dir, page_size=4, max_extend_tokens=64, cuda_graph_max_bs=4,
                 max_running_requests=4, num_pages=200, policy="stall_free")
    graphs = llm.runner.graphs
    assert graphs is not None and graphs.prefill_sizes == [64]
    replayed: list[int] = []
    run = graphs.run

    def counting(graph: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        if graph.shape.phase == "prefill":
            replayed.append(id(batch))
        return run(graph, batch, *args, **kwargs)

    graphs.run = counting  # type: ignore[method-assign]
    launched = record_phases(llm)
    params = [greedy(n) for n in max_tokens]
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    mixed = {id(b.batch) for b in launched if b.phase == "mixed"}
    assert mixed and mixed <= set(replayed), "every mixed batch (<= 64 tokens) replayed"


# ---- the embedded model --------------------------------------------------------------------

EMBEDDED = {"dtype": "float32", "device": "cpu", "cache_type": "radix", "chunked_prefill": True,
            "max_extend_tokens": 16, "max_running_requests": 4, "kv_cache_gb": 0.25}
MAX_TOKENS = 8


def embedded_prompts() -> list[list[int]]:
    """Six prompts of 5 to 40 tokens, two sharing a prefix: longer than the budget's rest."""
    base = [504, 3458, 282, 4649, 314, 253, 1015, 28, 5248, 2843, 30, 378]
    return [base[:5], base + list(range(600, 628)), base[:9] + list(range(700, 711)),
            list(range(900, 934)), [*base, 42, 43], list(range(1200, 1207))]


@pytest.fixture(scope="module")
def embedded_reference(smollm2_dir: Path) -> list[list[int]]:
    hf = load_hf(smollm2_dir)
    return [hf_greedy(hf, p, MAX_TOKENS) for p in embedded_prompts()]


@pytest.mark.slow
def test_stall_free_on_the_embedded_model_equals_prefill_first_and_transformers(
        smollm2_dir: Path, embedded_reference: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    got = {}
    for policy in ("stall_free", "prefill_first"):
        llm = LLM(str(smollm2_dir), policy=policy, **EMBEDDED)
        launched = record_phases(llm)
        got[policy] = [o.token_ids for o in llm.generate(embedded_prompts(), params,
                                                          use_tqdm=False)]
        assert ("mixed" in [b.phase for b in launched]) == (policy == "stall_free")
        llm.close()
    assert got["stall_free"] == got["prefill_first"] == embedded_reference


# Per policy through the server: its flags, how many times each prompt is sent at once,
# and the metric whose count shows the policy at work.
SERVED: dict[str, tuple[tuple[str, ...], int, str]] = {
    # Concurrent token-id prompts, so decodes share batches with prefills.
    "stall_free": ((), 1, 'asyncinfer_batches_total{phase="mixed"}'),
    # Radix: each prompt sent twice at once, so later copies match what earlier ones cached
    # and lpm reorders them.
    "lpm": (("--cache-type", "radix"), 2, "asyncinfer_prefix_cache_hits"),
}


@pytest.mark.slow
@pytest.mark.parametrize("policy", SERVED)
async def test_a_policy_through_the_server_is_token_exact(
        smollm2_dir: Path, embedded_reference: list[list[int]], policy: str) -> None:
    """stall_free (batches mixed) and lpm (prefix-cache hits) with chunked prefill, under
    concurrent completions: every answer is transformers'."""
    import aiohttp

    from tests.test_server_process import start_server

    flags, copies, counter = SERVED[policy]
    proc, url = start_server(smollm2_dir, "--policy", policy, "--max-extend-tokens", "16",
                             "--chunked-prefill", *flags)
    try:
        async with aiohttp.ClientSession() as session:
            async def one(prompt: list[int]) -> list[int]:
                body = {"input_ids": prompt, "sampling_params": {
                    "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}}
                async with session.post(f"{url}/generate", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    data = await resp.json()
                return list(data["token_ids"])

            got = await asyncio.gather(*(one(p) for p in embedded_prompts() * copies))
            async with session.get(f"{url}/metrics") as resp:
                metrics = await resp.text()
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    assert list(got) == embedded_reference * copies
    count = next(line for line in metrics.splitlines() if line.startswith(counter))
    assert float(count.split()[-1]) > 0
