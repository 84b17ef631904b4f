"""Penalties, logit_bias and min_tokens on the CUDA path: the same torch code as on the CPU,
so a float32 CUDA engine gives the CPU engine's tokens, and the plain rows beside the
penalized ones keep their own."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncinfer.api import LLM
from asyncinfer.params import SamplingParams
from tests.gpu.conftest import needs_gpu

pytestmark = [pytest.mark.gpu, needs_gpu]

FIELDS = [{}, {"presence_penalty": 1.5}, {"frequency_penalty": 0.8},
          {"repetition_penalty": 1.3}, {"logit_bias": {7: 5.0, 9: -100.0}},
          {"min_tokens": 12, "stop_token_ids": [5]}, {}]


def _tokens(model_dir: Path, device: str) -> list[list[int]]:
    prompts = [list(range(3 + i, 30 + 2 * i)) for i in range(len(FIELDS))]
    params = [SamplingParams(max_tokens=16, temperature=0.0, **f) for f in FIELDS]
    llm = LLM(str(model_dir), skip_tokenizer_init=True, device=device, dtype="float32",
              attention_backend="torch", cuda_graph=False, max_running_requests=8,
              max_seq_len=256, num_pages=128)
    try:
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.close()


def test_penalized_rows_on_cuda_give_the_cpu_engines_tokens(tiny_llama_dir: Path) -> None:
    assert _tokens(tiny_llama_dir, "cuda") == _tokens(tiny_llama_dir, "cpu")
