"""GPU fixtures: small random models whose head size (128) flashinfer compiles kernels for.

Every test here is marked ``gpu`` and skips itself without CUDA or flashinfer; run them on
the device machine with ``nox -s gpu-tests`` (see DEVELOPERS.md).
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


@pytest.fixture(scope="session")
def llama_h128_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama, 2 layers, 8 query heads over 2 KV heads of 128: tensor-core decode."""
    from transformers import LlamaConfig

    return _save_tiny(LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=1,
        bos_token_id=0), tmp_path_factory.mktemp("llama-h128"))


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
