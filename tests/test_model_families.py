"""Qwen2 is token-exact with transformers; config fields no family computes are refused."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from asyncinfer.api import LLM
from asyncinfer.errors import UnsupportedModelError
from tests.conftest import _save_tiny
from tests.test_model_outputs import generate_ids, reference


def _tiny_qwen2(path: Path, **options: Any) -> Path:
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=512, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, eos_token_id=1, bos_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **options)
    return _save_tiny(config, path)


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer random Qwen2: biases on q, k, v (random, not zero), none on o."""
    return _tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.mark.parametrize("options", [{"page_size": 16}, {"page_size": 4, "max_extend_tokens": 6}])
def test_qwen2_greedy_matches_transformers(tiny_qwen2_dir: Path,
                                           options: dict[str, Any]) -> None:
    prompts, expected = reference(tiny_qwen2_dir)
    assert generate_ids(tiny_qwen2_dir, prompts, **options) == expected


def test_a_window_as_long_as_the_context_runs_as_plain_attention(tmp_path: Path) -> None:
    """Every layer slides over 256 tokens, the engine's whole context: transformers'
    tokens."""
    model_dir = _tiny_qwen2(tmp_path, use_sliding_window=True, sliding_window=256,
                            max_window_layers=0)
    prompts, expected = reference(model_dir)
    assert generate_ids(model_dir, prompts) == expected


def _edited(model_dir: Path, target: Path, **fields: Any) -> Path:
    """A copy of ``model_dir`` whose config.json has ``fields`` set."""
    shutil.copytree(model_dir, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **fields}))
    return target


@pytest.mark.parametrize("fields, named", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"num_local_experts": 8, "num_experts_per_tok": 2}, "num_local_experts=8"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_type='dynamic'"),
])
def test_a_llama_field_that_is_not_implemented_is_refused_by_name(
        tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        fields: dict[str, Any], named: str) -> None:
    """Refused before any weight is read."""
    def load_model(*args: object) -> None:
        raise AssertionError("the weights loaded before the config was checked")

    model_dir = _edited(tiny_llama_dir, tmp_path / "model", **fields)
    monkeypatch.setattr("asyncinfer.engine.runner.ModelRunner._load_model", load_model)
    with pytest.raises(UnsupportedModelError, match=re.escape(named)):
        LLM(str(model_dir), skip_tokenizer_init=True, dtype="float32", num_pages=64)


def test_a_window_shorter_than_the_context_is_refused(tiny_qwen2_dir: Path,
                                                      tmp_path: Path) -> None:
    model_dir = _edited(tiny_qwen2_dir, tmp_path / "model", use_sliding_window=True,
                        sliding_window=64, max_window_layers=0, layer_types=None)
    with pytest.raises(UnsupportedModelError, match=r"sliding_window=64 .*256 tokens"):
        LLM(str(model_dir), skip_tokenizer_init=True, dtype="float32", num_pages=64,
            max_seq_len=256)
    # Those layers attend fully when the window only starts above max_window_layers.
    model_dir = _edited(tiny_qwen2_dir, tmp_path / "full", use_sliding_window=True,
                        sliding_window=64, max_window_layers=3, layer_types=None)
    LLM(str(model_dir), skip_tokenizer_init=True, dtype="float32", num_pages=64,
        max_seq_len=256).close()
