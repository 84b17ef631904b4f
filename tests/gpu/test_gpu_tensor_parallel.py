"""Tensor parallelism on two GPUs with NCCL: greedy bf16 outputs of two ranks equal one
rank's for the first 32 tokens of every prompt of a varied batch, with the divergence guard
comparing every batch; CUDA-graph decode equals eager at two ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.conftest import needs_gpu
from tests.gpu.test_gpu_engine import alternation_prompts, assert_nothing_held, generate

pytestmark = [pytest.mark.gpu, needs_gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

TP = {"tensor_parallel_size": 2, "tp_guard_interval": 1}


@pytest.mark.parametrize("model", ["trained_qwen3_dir", "trained_llama_dir"])
def test_two_ranks_give_one_ranks_greedy_tokens(model: str,
                                                request: pytest.FixtureRequest) -> None:
    import torch.distributed as dist

    model_dir: Path = request.getfixturevalue(model)
    prompts = alternation_prompts(seed=3)
    alone, llm = generate(model_dir, prompts)
    llm.close()
    split, llm = generate(model_dir, prompts, **TP)
    assert llm.runner.tp.size == 2 and llm.runner.graphs is not None
    assert_nothing_held(llm)
    llm.close()
    assert not dist.is_initialized()
    mismatched = [i for i, (a, b) in enumerate(zip(split, alone)) if a != b]
    assert not mismatched, [(len(prompts[i]), split[i], alone[i]) for i in mismatched]


def test_cuda_graph_decode_equals_eager_on_two_ranks(trained_qwen3_dir: Path) -> None:
    prompts = alternation_prompts(seed=4)
    graphs, llm = generate(trained_qwen3_dir, prompts, cuda_graph_max_bs=32,
                           cuda_graph_max_prefill_tokens=0, **TP)
    graphed = llm.runner.graphs
    assert graphed is not None and sum(g.replays for g in graphed.decode) > 0
    llm.close()  # frees the graphs (and the collectives they captured) though held here
    assert all(g.cuda_graph is None for g in graphed.decode)
    eager, llm = generate(trained_qwen3_dir, prompts, cuda_graph=False, **TP)
    llm.close()
    assert graphs == eager
