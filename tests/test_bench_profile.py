"""The trace arithmetic of the GPU benchmark's profiles (pure Python, no device)."""

from __future__ import annotations

import pytest
from benchmarks.kernel_profile import _union_ms, idle_gaps, kernel_class


def test_union_counts_overlapping_kernels_once() -> None:
    assert _union_ms([(0, 1000), (500, 1500), (3000, 4000)]) == pytest.approx(2.5)


def test_idle_gaps_by_length_and_by_tenth_of_run() -> None:
    # Kernels at 0-10 µs, 11-20 (1 µs gap), 50-60 (30 µs gap), then 2060-2100 (2000 µs gap).
    out = idle_gaps([(0.0, 10.0), (11, 20), (15, 18), (50, 60), (2060, 2100.0)])
    assert out["gaps_by_length"] == {"0-2us": 1, "2-5us": 0, "5-20us": 0, "20-100us": 1,
                                     "100-1000us": 0, "1000-infus": 1}
    assert out["idle_s_by_gap"]["20-100us"] == pytest.approx(30e-6)
    assert sum(out["idle_s_by_gap"].values()) == pytest.approx(2031e-6)
    # All three gaps begin in the first tenth of the 2100 µs run.
    assert out["idle_s_by_tenth_of_run"][0] == pytest.approx(2031e-6)
    assert sum(out["idle_s_by_tenth_of_run"][1:]) == 0
    assert out["longest_gaps_ms"] == [[0.06, 2.0], [0.02, 0.03], [0.01, 0.001]]


def test_idle_gaps_of_one_kernel_is_empty() -> None:
    assert idle_gaps([(0, 10)]) == {}


@pytest.mark.parametrize(("name", "cls"), [
    ("void flashinfer::BatchPrefillWithPagedKVCacheKernel<...>", "attention"),
    ("nvjet_sm90_tst_64x32_64x16_1x2_h_bz_TNT", "matmul"),
    ("triton_poi_fused_mul_silu_split_0", "other")])
def test_kernel_class(name: str, cls: str) -> None:
    assert kernel_class(name) == cls


def test_host_stalls_lists_slowest_rounds_and_collections() -> None:
    from benchmarks.gpu_offline import host_stalls

    from asyncinfer.coordinator import Round

    rounds = [Round(10.0, 0.001, 0.002, "decode", 8), Round(10.5, 0.030, 0.0, "prefill", 3),
              Round(11.0, 0.002, 0.001, "decode", 3)]
    out = host_stalls(rounds, [(10.6, 0.2, 2), (10.7, 0.0005, 0)], start=10.0, longest=2)
    assert out["slowest_rounds"] == [[500.0, 30.0, 0.0, "prefill", 3],
                                     [1000.0, 2.0, 1.0, "decode", 3]]
    assert out["gc_ms_by_generation"] == {0: 0.5, 1: 0, 2: 200.0}
    assert out["gc_over_1ms"] == [[600.0, 200.0, 2]]


def test_gc_pauses_records_collections_only_inside_the_block() -> None:
    import gc

    from benchmarks.gpu_offline import gc_pauses

    callbacks = list(gc.callbacks)
    with gc_pauses() as pauses:
        gc.collect()
    gc.collect()
    assert [generation for _, _, generation in pauses] == [2]
    assert pauses[0][1] >= 0
    assert gc.callbacks == callbacks


def test_host_rounds_runs_every_request_to_its_length_through_the_null_engine() -> None:
    from benchmarks.host_rounds import measure

    prompts = [[7] * n for n in (30, 5, 64, 17, 40)]
    max_tokens = [3, 9, 1, 6, 12]
    out = measure(prompts, max_tokens, max_rows=4, page_size=4, extend_tokens=64)
    assert out["tokens"] == sum(max_tokens)
    # Each request's first token comes from its prefill, the rest from decode rows.
    assert out["decode_rows"] == sum(m - 1 for m in max_tokens)
    assert out["rounds"] > max(max_tokens) - 1 and out["ms_per_round"] > 0
