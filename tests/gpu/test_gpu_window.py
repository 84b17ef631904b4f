"""Sliding windows on a GPU: flashinfer, planned with ``window_left`` (eager and in CUDA
graphs), gives the torch backend's tokens on a Mistral trained on alternation whose window
of 64 is far shorter than its prompts, and close logits on random prompts; the torch backend
in float32 gives transformers' tokens."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from asyncinfer.attention.flashinfer_backend import FlashInferBackend
from asyncinfer.config import EngineConfig
from asyncinfer.core import Batch
from asyncinfer.engine.runner import ModelRunner
from tests.gpu.conftest import _TRAINED_SHAPE, _train_alternation, needs_gpu
from tests.gpu.test_gpu_engine import GREEDY, alternation_prompts, generate
from tests.hf_reference import hf_greedy, load_hf, place_rows

pytestmark = [pytest.mark.gpu, needs_gpu]

WINDOW = 64


@pytest.fixture(scope="module")
def trained_mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import MistralConfig

    return _train_alternation(
        MistralConfig(num_attention_heads=8, tie_word_embeddings=False,
                      sliding_window=WINDOW, **_TRAINED_SHAPE),
        tmp_path_factory.mktemp("trained-mistral"))


@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_window_equals_torch_backend(trained_mistral_dir: Path,
                                                page_size: int) -> None:
    prompts = alternation_prompts()
    ours, llm = generate(trained_mistral_dir, prompts, page_size=page_size,
                         attention_backend="flashinfer")
    backend = llm.runner.backend
    assert isinstance(backend, FlashInferBackend) and llm.runner.graphs is not None
    assert set(backend.prefill) == {WINDOW}
    llm.close()
    reference, _ = generate(trained_mistral_dir, prompts, page_size=page_size,
                            attention_backend="torch")
    assert ours == reference


def test_float32_window_on_cuda_is_transformers_greedy(trained_mistral_dir: Path) -> None:
    """The torch backend on CUDA in float32, batched with radix hits, against transformers'
    own windowed attention: what the bf16 comparison above takes as its reference."""
    prompts = alternation_prompts()
    ours, llm = generate(trained_mistral_dir, prompts, dtype="float32",
                         attention_backend="torch", cuda_graph=False)
    llm.close()
    hf = load_hf(trained_mistral_dir)
    assert ours == [hf_greedy(hf, p, len(ours[0])) for p in prompts]


def test_flashinfer_window_logits_are_the_torch_backends(trained_mistral_dir: Path) -> None:
    """Random 300-token prompts, where the window decides what is attended."""
    rng = random.Random(0)
    seqs = [[rng.randrange(3, 500) for _ in range(n)] for n in (300, 130, 65)]
    logits = []
    for backend in ("flashinfer", "torch"):
        runner = ModelRunner(EngineConfig(device="cuda", dtype="bfloat16", num_pages=256,
                                          max_seq_len=512, attention_backend=backend,
                                          cuda_graph=False), trained_mistral_dir)
        place_rows(runner, seqs)
        n = len(seqs)
        out = runner.forward(Batch(rows=list(range(n)), starts=[0] * n,
                                   ends=[len(s) for s in seqs], params=[GREEDY] * n,
                                   steps=[0] * n))
        logits.append(out.logits.float().cpu())
    assert (logits[0] - logits[1]).abs().max() <= 0.02 * logits[1].abs().max()
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
