"""Shared fixtures: the embedded SmolLM2 and tiny random Llama / Qwen3 models saved to disk."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# A test that needs the embedded SmolLM2 (fetched and converted into the cache on first use)
# is marked slow, by the fixtures that hand it over: `-m "not slow"` runs the others.
EMBEDDED_MODEL_FIXTURES = {"smollm2_dir", "served_model", "plain_server"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if EMBEDDED_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded default model (fetched and converted into the cache on first use)."""
    from asyncinfer.models.source import embedded_model_dir

    return embedded_model_dir()


def engine_under_test() -> tuple[str | None, dict[str, Any]]:
    """Model and options of the end-to-end HTTP tests: the embedded SmolLM2 in float32 on the
    CPU, unless ASYNCINFER_TEST_DEVICE (cuda: bfloat16, flashinfer) and ASYNCINFER_TEST_MODEL
    (a local model directory) say otherwise; the GPU run uses both (see DEVELOPERS.md)."""
    device = os.environ.get("ASYNCINFER_TEST_DEVICE", "cpu")
    model = os.environ.get("ASYNCINFER_TEST_MODEL") or None
    if device == "cpu":
        return model, {"device": device, "dtype": "float32", "cache_type": "radix"}
    # In bf16 a prefix-cache hit changes the shapes of the products, hence their rounding;
    # the random model's near-ties then differ from a cold run's: compare cold runs.
    return model, {"device": device, "dtype": "bfloat16", "cache_type": "naive"}


@pytest.fixture(scope="session")
def served_model() -> Path:
    """The model directory behind the end-to-end HTTP tests (fetched if it is the embedded)."""
    from asyncinfer.models.source import resolve_model

    return resolve_model(engine_under_test()[0])


@pytest.fixture(scope="session")
def plain_server(served_model: Path) -> Iterator[str]:
    """The URL of one `asyncinfer serve` of ``served_model`` with no extra options, shared by
    the HTTP tests that need nothing else (a start is many seconds on two cores)."""
    from tests.test_server_process import served

    with served(served_model) as url:
        yield url


def _save_tiny(config, path: Path) -> Path:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init is near-uniform over the vocabulary; widen the weights so argmax margins
    # are far above float32 noise, as in a trained model.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.2 if "embed" in name else 0.08)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer random Llama with GQA and untied embeddings."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, eos_token_id=1, bos_token_id=0,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 256},
    )
    return _save_tiny(config, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_chat_llama_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama (8 heads, 2 KV heads: splits over 2 ranks, which SmolLM2's 9
    heads do not) with SmolLM2's tokenizer and chat template: text in, text out."""
    import shutil

    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    path = _save_tiny(config, tmp_path_factory.mktemp("tiny-chat-llama"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer random Qwen3 (q/k RMSNorm, explicit head_dim) with tied embeddings."""
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=512, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=1,
        bos_token_id=0,
    )
    return _save_tiny(config, tmp_path_factory.mktemp("tiny-qwen3"))
