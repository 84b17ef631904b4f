"""`asyncinfer bench offline`: the fixed workloads, and a run over two tensor-parallel ranks
whose report counts every token the workload asks for."""

from __future__ import annotations

import json
from pathlib import Path

from asyncinfer.bench.throughput import SHAPES, offline_workload, shape_dir
from asyncinfer.cli import main
from asyncinfer.config import ModelConfig


def test_workloads_are_the_same_on_every_run() -> None:
    prompts, max_tokens = offline_workload("cpu")
    assert (len(prompts), sum(max_tokens)) == (64, 9896)
    assert all(32 <= len(p) <= 512 for p in prompts)
    assert offline_workload("cpu") == (prompts, max_tokens)
    gpu_prompts, gpu_tokens = offline_workload("gpu")
    assert len(gpu_prompts) == 256 and all(100 <= n <= 1024 for n in gpu_tokens)


def test_shapes_are_models_the_engine_reads(tmp_path: Path) -> None:
    for name in SHAPES:
        config = ModelConfig.from_pretrained(shape_dir(name, tmp_path))
        assert config.num_heads % 2 == 0 and config.num_kv_heads % 2 == 0


def test_bench_offline_on_two_ranks_reports_every_token(tiny_chat_llama_dir: Path,
                                                        tmp_path: Path,
                                                        capsys: object) -> None:
    report_path = tmp_path / "report.json"
    code = main(["bench", "offline", "--model", str(tiny_chat_llama_dir), "--tp", "2",
                 "--dtype", "float32", "--json", str(report_path)])
    assert code == 0
    report = json.loads(report_path.read_text())
    assert (report["tokens"], report["requests"], report["tensor_parallel_size"]) == (
        9896, 64, 2)
    assert report["tokens_per_s"] > 0 and report["benchmark"] == "offline-cpu"
    # The CPU it ran on, so that CPU figures are compared on the same kind only.
    assert report["machine"]["cores"] >= 1 and report["machine"]["cpu"]
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    assert ("avx2" in report["machine"]["cpu_flags"]) == ("avx2" in flags)
    assert "tok/s" in capsys.readouterr().out  # type: ignore[attr-defined]
