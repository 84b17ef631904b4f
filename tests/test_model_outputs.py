"""Greedy decoding and logits of our model path equal transformers' on the same weights."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from asyncinfer.api import LLM
from asyncinfer.config import EngineConfig
from asyncinfer.core import Batch
from asyncinfer.engine.runner import ModelRunner
from asyncinfer.params import SamplingParams
from tests.hf_reference import hf_greedy, hf_last_logits, load_hf, place_rows

NEW_TOKENS = 64
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def varied_prompts(vocab: int, seed: int) -> list[list[int]]:
    """Eight prompts of different lengths; three share one prefix, two share another."""
    rng = random.Random(seed)
    shared_a = [rng.randrange(3, vocab) for _ in range(23)]
    shared_b = [rng.randrange(3, vocab) for _ in range(9)]
    prompts = [shared_a + [rng.randrange(3, vocab) for _ in range(n)] for n in (1, 7, 30)]
    prompts += [shared_b + [rng.randrange(3, vocab) for _ in range(n)] for n in (0, 14)]
    prompts += [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 61)]
    return prompts


_REFERENCE: dict[str, tuple[list[list[int]], list[list[int]]]] = {}


def reference(model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and transformers' greedy continuations, computed once per model."""
    key = str(model_dir)
    if key not in _REFERENCE:
        hf = load_hf(model_dir)
        prompts = varied_prompts(min(hf.config.vocab_size, 10000), seed=len(key))
        _REFERENCE[key] = prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    return _REFERENCE[key]


def make_runner(model_dir: Path, page_size: int) -> ModelRunner:
    config = EngineConfig(dtype="float32", page_size=page_size, max_running_requests=20,
                          max_seq_len=255, num_pages=8192 // page_size)
    return ModelRunner(config, model_dir)


@pytest.fixture(params=["tiny_llama_dir", "tiny_qwen3_dir", "smollm2_dir"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


def generate_ids(model_dir: Path, prompts: list[list[int]], **options: object) -> list[list[int]]:
    """Greedy outputs of ``LLM.generate`` for token-id prompts."""
    llm = LLM(str(model_dir), skip_tokenizer_init=True, dtype="float32",
              max_running_requests=8, max_seq_len=256, **options)
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_batch_matches_transformers(model_dir: Path, page_size: int) -> None:
    prompts, expected = reference(model_dir)
    assert generate_ids(model_dir, prompts, page_size=page_size) == expected


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_prefill_in_chunks_over_cached_prefix_matches_transformers(
    model_fixture: str, request: pytest.FixtureRequest
) -> None:
    model_dir = request.getfixturevalue(model_fixture)
    prompts, expected = reference(model_dir)
    got = generate_ids(model_dir, prompts, page_size=4, max_extend_tokens=6)
    assert got == expected


def test_mixed_batch_logits_match_transformers(model_dir: Path) -> None:
    """One forward holding a decode, an extend over a cached prefix and a fresh prefill."""
    runner = make_runner(model_dir, page_size=16)
    hf = load_hf(model_dir)
    rng = random.Random(1)
    seqs = [[rng.randrange(3, 500) for _ in range(n)] for n in (17, 40, 9)]
    place_rows(runner, seqs)
    # Round one caches all but the last token of request 0 and the first 25 of request 1.
    runner.forward(Batch(rows=[0, 1], starts=[0, 0], ends=[16, 25], params=[GREEDY] * 2,
                         steps=[0, 0], sample=[False, False]))
    mixed = Batch(rows=[0, 1, 2], starts=[16, 25, 0], ends=[17, 40, 9], params=[GREEDY] * 3,
                  steps=[0, 0, 0], sample=[False] * 3)
    assert mixed.phase == "prefill"
    logits = runner.forward(mixed).logits
    for i, seq in enumerate(seqs):
        ref = hf_last_logits(hf, seq)
        assert (logits[i] - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_batch_logits_match_transformers(tiny_llama_dir: Path, page_size: int) -> None:
    """The padded decode path: requests of different cached lengths in one decode round."""
    runner = make_runner(tiny_llama_dir, page_size=page_size)
    hf = load_hf(tiny_llama_dir)
    rng = random.Random(2)
    # Twenty requests: the decode path splits them into groups of similar length.
    seqs = [[rng.randrange(3, 500) for _ in range(rng.randrange(2, 60))] for _ in range(20)]
    place_rows(runner, seqs)
    rows = list(range(len(seqs)))
    n = len(seqs)
    runner.forward(Batch(rows=rows, starts=[0] * n, ends=[len(s) - 1 for s in seqs],
                         params=[GREEDY] * n, steps=[0] * n, sample=[False] * n))
    decode = Batch(rows=rows, starts=[len(s) - 1 for s in seqs], ends=[len(s) for s in seqs],
                   params=[GREEDY] * n, steps=[0] * n, sample=[False] * n)
    assert decode.phase == "decode"
    logits = runner.forward(decode).logits
    for i, seq in enumerate(seqs):
        ref = hf_last_logits(hf, seq)
        assert (logits[i] - ref).abs().max() <= 1e-4 * ref.abs().max()
