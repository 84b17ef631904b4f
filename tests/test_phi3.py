"""Phi-3 (fused qkv_proj and gate_up_proj checkpoints, a sliding window) is token-exact with
transformers; longrope and partial rotary are refused by name. Both windowed families (Phi-3
and Mistral) at two ranks, and in bf16 against float32 transformers."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest

from asyncinfer.api import LLM
from asyncinfer.core import Batch
from asyncinfer.errors import UnsupportedModelError
from tests.conftest import _save_tiny
from tests.hf_reference import hf_greedy, hf_last_logits, load_hf, place_rows
from tests.test_model_families import _edited
from tests.test_sliding_window import (
    GREEDY,
    NEW_TOKENS,
    WINDOW,
    _tiny_mistral,
    expected,
    generate,
    window_prompts,
)
from tests.test_weights_and_dtypes import runner_for


def tiny_phi3(path: Path, window: int | None = WINDOW, **options: Any) -> Path:
    from transformers import Phi3Config

    config = Phi3Config(
        vocab_size=512, hidden_size=128, intermediate_size=192, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
        original_max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=1,
        bos_token_id=0, pad_token_id=2, sliding_window=window, **options)
    return _save_tiny(config, path)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer random Phi-3 (GQA 8/4) with a window of 16."""
    return tiny_phi3(tmp_path_factory.mktemp("tiny-phi3"))


_REFERENCE: dict[str, list[list[int]]] = {}


def phi3_expected(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    key = str(model_dir)
    if key not in _REFERENCE:
        hf = load_hf(model_dir)
        _REFERENCE[key] = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    return _REFERENCE[key]


def test_the_checkpoint_holds_fused_projections(phi3_dir: Path) -> None:
    from safetensors import safe_open

    [shard] = phi3_dir.glob("*.safetensors")
    with safe_open(str(shard), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".up_proj." in n.replace("gate_up", "") for n in names)


@pytest.mark.parametrize("options", [
    {"cpu_kernels": False, "page_size": 16},
    {"cpu_kernels": True, "page_size": 4, "max_extend_tokens": 6},
], ids=["sdpa", "kernels-chunked"])
def test_phi3_greedy_matches_transformers(phi3_dir: Path, options: dict[str, Any]) -> None:
    prompts = window_prompts()
    assert generate(phi3_dir, prompts, **options) == phi3_expected(phi3_dir, prompts)


def test_phi3_without_a_window_matches_transformers(tmp_path: Path) -> None:
    model_dir = tiny_phi3(tmp_path / "full", window=None)
    prompts = window_prompts(seed=5)[:4]
    hf = load_hf(model_dir)
    assert generate(model_dir, prompts) == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0,
             "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
             "original_max_position_embeddings": 256}


@pytest.mark.parametrize("fields, named", [
    ({"rope_scaling": {**_LONGROPE, "rope_type": "su"}, "rope_parameters": None},
     "rope_type='longrope'"),
    ({"rope_parameters": _LONGROPE}, "rope_type='longrope'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
])
def test_what_phi3_does_not_compute_is_refused_by_name(
        phi3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        fields: dict[str, Any], named: str) -> None:
    """longrope ("su" in older configs) scales rotary by the sequence's length; refused
    before any weight is read."""
    def load_model(*args: object) -> None:
        raise AssertionError("the weights loaded before the config was checked")

    model_dir = _edited(phi3_dir, tmp_path / "model", **fields)
    monkeypatch.setattr("asyncinfer.engine.runner.ModelRunner._load_model", load_model)
    with pytest.raises(UnsupportedModelError, match=re.escape(named)):
        LLM(str(model_dir), skip_tokenizer_init=True, dtype="float32", num_pages=64)


@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_two_ranks_match_transformers(family: str, phi3_dir: Path,
                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tensor parallelism on CPU (gloo): each rank keeps its rows of every fused part (Phi-3)
    and attends its heads through the window; transformers' tokens."""
    prompts = window_prompts()
    if family == "phi3":
        model_dir, want = phi3_dir, phi3_expected(phi3_dir, prompts)
    else:
        model_dir = _tiny_mistral(tmp_path_factory.mktemp("tp-mistral"))
        want = expected(model_dir, prompts)
    got = generate(model_dir, prompts, tensor_parallel_size=2, page_size=4,
                   max_extend_tokens=48, tp_guard_interval=1)
    assert got == want


@pytest.mark.parametrize("fp32_kernels", ["on", "off"])
@pytest.mark.parametrize("family", ["mistral", "phi3"])
def test_bf16_logits_past_the_window_are_close_to_float32_transformers(
        family: str, fp32_kernels: str, phi3_dir: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A 60-token prompt (prefill) and its next position (a decode step), both past the
    window of 16, in bf16 on the CPU kernels: the top token is float32 transformers', every
    logit within 5% of the largest."""
    model_dir = phi3_dir if family == "phi3" else _tiny_mistral(
        tmp_path_factory.mktemp("bf16-mistral"))
    hf = load_hf(model_dir)
    runner = runner_for(model_dir, dtype="bfloat16", cpu_fp32_compute=fp32_kernels)
    rng = random.Random(7)
    seq = [rng.randrange(3, 500) for _ in range(60)]
    place_rows(runner, [seq])
    prefill = runner.forward(Batch(rows=[0], starts=[0], ends=[60], params=[GREEDY],
                                   steps=[0]))
    seq.append(int(prefill.next_tokens[0]))  # the decode step reads the sampled token
    decode = runner.forward(Batch(rows=[0], starts=[60], ends=[61], params=[GREEDY],
                                  steps=[0]))
    for out, length in ((prefill, 60), (decode, 61)):
        ref = hf_last_logits(hf, seq[:length])
        logits = out.logits[0].float()
        assert (logits - ref).abs().max() <= 0.05 * ref.abs().max()
        assert int(logits.argmax()) == int(ref.argmax())
