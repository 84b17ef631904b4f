"""The batch-invariant mode on a GPU, through its Triton kernels: SmolLM2 in bf16, one
request's tokens and logprobs bit for bit the same alone, beside others, in chunks and after
a prefix-cache hit, greedy and seeded (with top-p)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from asyncinfer.api import LLM
from asyncinfer.params import SamplingParams
from tests.gpu.conftest import needs_gpu

pytestmark = [pytest.mark.gpu, needs_gpu]

_RNG = random.Random(38)
_BASE = [_RNG.randint(10, 40000) for _ in range(900)]
PROMPTS = [_BASE[:n] + [_RNG.randint(10, 40000) for _ in range(m)]
           for n, m in ((0, 300), (120, 40), (0, 7), (800, 3), (64, 700))]


def _engine(model: Path, **options: object) -> LLM:
    return LLM(str(model), skip_tokenizer_init=True, device="cuda", dtype="bfloat16",
               batch_invariant=True, max_running_requests=16, max_seq_len=2048,
               **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3),
    SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True,
                   logprobs=3)], ids=["greedy", "seeded"])
def test_one_request_answers_alike_in_any_batch_chunking_and_cache_state(
        smollm2_dir: Path, params: SamplingParams) -> None:
    reference = _engine(smollm2_dir, cache_type="naive")
    try:
        alone = reference.generate([PROMPTS[0]], params, use_tqdm=False)[0]
        batched = reference.generate(PROMPTS, params, use_tqdm=False)[0]
    finally:
        reference.close()
    radix = _engine(smollm2_dir, max_extend_tokens=96)
    try:
        chunked = radix.generate(PROMPTS[::-1], params, use_tqdm=False)[-1]
        hit = radix.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    finally:
        radix.close()
    assert hit.cached_tokens > 0
    for out in (batched, chunked, hit):
        assert out.token_ids == alone.token_ids
        assert [x.logprob for x in out.logprobs] == [x.logprob for x in alone.logprobs]
