"""Logprobs on the CUDA path: through the engine stream's pinned copies (float32, torch
backend, against transformers on the GPU) and read from CUDA graphs' logits (flashinfer,
bf16), with requests that ask for none unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncinfer.api import LLM
from asyncinfer.params import SamplingParams
from tests.gpu.conftest import needs_gpu
from tests.gpu.test_gpu_engine import alternation_prompts
from tests.hf_reference import load_hf

pytestmark = [pytest.mark.gpu, needs_gpu]


def greedy(n: int, **fields: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **fields)


@torch.inference_mode()
def test_float32_logprobs_on_cuda_equal_transformers(tiny_llama_dir: Path) -> None:
    prompts = [list(range(3 + i, 40 + 3 * i)) for i in range(6)]
    params = [greedy(8, logprobs=5, prompt_logprobs=2 if i % 2 else None) if i % 3 else
              greedy(8) for i in range(6)]
    llm = LLM(str(tiny_llama_dir), skip_tokenizer_init=True, device="cuda", dtype="float32",
              attention_backend="torch", max_running_requests=8, max_seq_len=256,
              kv_cache_gb=0.5, max_extend_tokens=32)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    plain = llm.generate(prompts, greedy(8), use_tqdm=False)
    llm.close()
    hf = load_hf(tiny_llama_dir).cuda()
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    for prompt, p, out in zip(prompts, params, outputs):
        if p.logprobs is None:
            assert out.logprobs is None
            continue
        seq = prompt + out.token_ids
        ref = torch.log_softmax(hf(torch.tensor([seq], device="cuda")).logits[0].float(), -1)
        assert out.logprobs is not None
        for t, entry in enumerate(out.logprobs):
            row = ref[len(prompt) - 1 + t]
            assert abs(entry.logprob - float(row[entry.token])) < 1e-4
            assert [i for i, _ in entry.top] == row.topk(5).indices.tolist()
        if p.prompt_logprobs is not None:
            assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
            for i, entry in enumerate(out.prompt_logprobs[1:], 1):
                assert entry is not None and entry.token == prompt[i]
                assert abs(entry.logprob - float(ref[i - 1, prompt[i]])) < 1e-4


def test_graph_replays_give_their_logits_logprobs(trained_llama_dir: Path) -> None:
    """Decode (and prefill) graphs: a greedy token is its row's most probable, its logprob
    the top one's; logprobs agree with an eager run's; tokens of requests asking for none
    are unchanged."""
    prompts = alternation_prompts(12)
    params = [greedy(16, logprobs=3) if i % 2 else greedy(16) for i in range(12)]
    runs = {}
    for graphs in (True, False):
        llm = LLM(str(trained_llama_dir), skip_tokenizer_init=True, device="cuda",
                  dtype="bfloat16", attention_backend="flashinfer", cuda_graph=graphs,
                  max_running_requests=16, max_seq_len=1200, kv_cache_gb=1.0)
        assert (llm.runner.graphs is not None) == graphs
        runs[graphs] = (llm.generate(prompts, params, use_tqdm=False),
                        llm.generate(prompts, greedy(16), use_tqdm=False))
        if graphs:
            assert llm.runner.graphs is not None
            assert sum(g.replays for g in llm.runner.graphs.decode) > 0
        llm.close()
    for outputs, plain in runs.values():
        assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
        for p, out in zip(params, outputs):
            if p.logprobs is None:
                assert out.logprobs is None
                continue
            assert out.logprobs is not None and len(out.logprobs) == 16
            for token, entry in zip(out.token_ids, out.logprobs):
                assert entry.token == token and entry.top[0] == (token, entry.logprob)
                assert entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]
    for a, b in zip(runs[True][0], runs[False][0]):
        if a.logprobs is not None and b.logprobs is not None and a.token_ids == b.token_ids:
            assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)
                       ) < 0.05
