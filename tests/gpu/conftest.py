"""GPU fixtures: small random models whose head size (128) flashinfer compiles kernels for.

Every test here is marked ``gpu`` and skips itself without CUDA or flashinfer; run them on
a CUDA machine with ``nox -s gpu-tests`` (see DEVELOPERS.md).
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import _save_tiny

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
    reason="needs a CUDA device and flashinfer-python")


@pytest.fixture(scope="session")
def qwen3_h128_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3, 3 layers, 4 query heads over 2 KV heads of 128: flashinfer's decode kernel."""
    from transformers import Qwen3Config

    return _save_tiny(Qwen3Config(
        vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=1,
        bos_token_id=0), tmp_path_factory.mktemp("qwen3-h128"))


VOCAB = 512
TRAIN_LEN = 800


def alternating(pair: tuple[int, int], length: int) -> list[int]:
    """a b a b ...: the next token is always the one two places back."""
    return [pair[i % 2] for i in range(length)]


def _train_alternation(config: object, path: Path, steps: int = 400) -> Path:
    """Train a small model on the device until it continues ``a b a b ...`` with certainty.

    Random weights make greedy decoding a string of near-ties, which bf16 rounding in any
    two correct attention kernels resolves differently within a few tokens. This task is
    solved only by attending to the previous position, and a trained model has margins of
    several nats, so two correct kernels must agree token for token.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator(device="cuda").manual_seed(0)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        pairs = torch.randint(3, VOCAB, (32, 2), device="cuda", generator=generator)
        batch = pairs[:, torch.arange(TRAIN_LEN, device="cuda") % 2]
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    # Two of TRAIN_LEN positions are unpredictable: about 2 ln(V) / TRAIN_LEN = 0.016.
    assert float(loss) < 0.05, f"alternation not learned: loss {float(loss):.3f}"
    model.eval().save_pretrained(path)
    return path


# What the two trained models share: 2 layers, 2 KV heads of 128 (flashinfer's head size).
_TRAINED_SHAPE = {"vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 512,
                  "num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 128,
                  "max_position_embeddings": 4096, "eos_token_id": 1, "bos_token_id": 0}


@pytest.fixture(scope="session")
def trained_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3 with 4 query heads (flashinfer's decode kernel), trained on alternation."""
    from transformers import Qwen3Config

    return _train_alternation(
        Qwen3Config(num_attention_heads=4, tie_word_embeddings=True, **_TRAINED_SHAPE),
        tmp_path_factory.mktemp("trained-qwen3"))


@pytest.fixture(scope="session")
def trained_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with 8 query heads (tensor-core decode), trained on alternation."""
    from transformers import LlamaConfig

    return _train_alternation(
        LlamaConfig(num_attention_heads=8, tie_word_embeddings=False, **_TRAINED_SHAPE),
        tmp_path_factory.mktemp("trained-llama"))


def make_chat_model(path: Path, tokenizer_dir: Path) -> Path:
    """A random Llama with SmolLM2's tokenizer and chat template, for the HTTP tests."""
    from transformers import LlamaConfig

    _save_tiny(LlamaConfig(
        vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=2048, tie_word_embeddings=True, eos_token_id=2,
        bos_token_id=1), path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    return path



@pytest.fixture(autouse=True)
def _release_gpu_memory() -> None:
    """Engines of earlier tests give their memory back before the next one sizes its pool."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
