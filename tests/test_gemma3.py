"""Gemma 3 (text) is token-exact with transformers in float32, close in bfloat16, and
refuses by name the config fields it does not compute."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncinfer.api import LLM
from asyncinfer.config import EngineConfig
from asyncinfer.core import Batch
from asyncinfer.engine.runner import ModelRunner
from asyncinfer.errors import UnsupportedModelError
from tests.hf_reference import hf_last_logits, load_hf, place_rows
from tests.test_model_outputs import GREEDY, generate_ids, reference

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
WINDOW = 16   # the reference prompts are 1 to 61 tokens, 64 generated: up to 7x the window


def _tiny_gemma3(path: Path, **options: Any) -> Path:
    """A 4-layer random Gemma 3: local, local, global, local (local layers slide over
    ``WINDOW``, shorter than most prompts); the local rope base far from
    the global one, linear rope scaling on the global layers, query_pre_attn_scalar apart
    from head_dim, and random (1 + w) norm weights."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    fields: dict[str, Any] = dict(
        vocab_size=512, hidden_size=96, intermediate_size=192, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
        max_position_embeddings=1024, sliding_window=WINDOW, layer_types=LAYER_TYPES,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}},
        eos_token_id=1, bos_token_id=2, pad_token_id=0)
    config = Gemma3TextConfig(**{**fields, **options})
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # wide weights: argmax margins far above float32 noise
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.3 if "norm" in name else 0.2 if "embed" in name else 0.08)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.mark.parametrize("options", [
    {"page_size": 16},
    {"page_size": 4, "max_extend_tokens": 6},   # chunked prefill over radix prefix hits
    {"page_size": 16, "cpu_kernels": False},
])
def test_gemma3_greedy_matches_transformers(tiny_gemma3_dir: Path,
                                            options: dict[str, Any]) -> None:
    """Eight prompts batched, three and two sharing prefixes: transformers' tokens."""
    prompts, expected = reference(tiny_gemma3_dir)
    assert generate_ids(tiny_gemma3_dir, prompts, **options) == expected


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
async def test_gemma3_through_async_engine_matches_transformers(tiny_gemma3_dir: Path,
                                                                overlap: bool) -> None:
    """Concurrent requests through AsyncEngine, scheduling overlapped with compute or not."""
    import asyncio

    from asyncinfer.api import AsyncEngine

    prompts, expected = reference(tiny_gemma3_dir)
    async with AsyncEngine(str(tiny_gemma3_dir), skip_tokenizer_init=True, dtype="float32",
                           page_size=4, max_running_requests=8, max_seq_len=256,
                           overlap=overlap) as engine:
        outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    assert [o.token_ids for o in outs] == expected


def test_gemma3_prefix_cache_hits_past_the_window_match_transformers(
        tiny_gemma3_dir: Path) -> None:
    """A second round over one engine finds every prompt cached (pages behind the window
    included) and gives transformers' tokens again."""
    prompts, expected = reference(tiny_gemma3_dir)
    llm = LLM(str(tiny_gemma3_dir), skip_tokenizer_init=True, dtype="float32",
              max_running_requests=8, max_seq_len=256, page_size=4)
    try:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        again = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.close()
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in again] == expected
    assert all(o.cached_tokens >= len(p) - 4 for o, p in zip(again, prompts))


def test_gemma3_layers_from_sliding_window_pattern_match_transformers(
        tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    """A config.json without ``layer_types`` but with the older ``sliding_window_pattern``
    (every second layer global): the layers transformers derives from it slide."""
    model_dir = _edited(tiny_gemma3_dir, tmp_path / "pattern", sliding_window_pattern=2)
    config = json.loads((model_dir / "config.json").read_text())
    del config["layer_types"]
    (model_dir / "config.json").write_text(json.dumps(config))
    from transformers import AutoConfig

    types = AutoConfig.from_pretrained(model_dir).layer_types
    assert types == ["sliding_attention", "full_attention"] * 2
    prompts, expected = reference(model_dir)
    assert generate_ids(model_dir, prompts) == expected


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_gemma3_bfloat16_logits_are_close_to_float32_transformers(
        tiny_gemma3_dir: Path, cpu_kernels: bool) -> None:
    """bf16 logits within 5% of the largest float32 logit (about 1.5% seen), the same top-1
    token; with the CPU kernels on, the (1 + w) norms must not take the plain-RMSNorm ones."""
    config = EngineConfig(dtype="bfloat16", max_running_requests=4, num_pages=64,
                          max_seq_len=256, cpu_kernels=cpu_kernels)
    runner = ModelRunner(config, tiny_gemma3_dir)
    hf = load_hf(tiny_gemma3_dir)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (40, 17, 64)]
    place_rows(runner, prompts)
    out = runner.forward(Batch(rows=[0, 1, 2], starts=[0] * 3, ends=[len(p) for p in prompts],
                               params=[GREEDY] * 3, steps=[0] * 3))
    for i, prompt in enumerate(prompts):
        ref = hf_last_logits(hf, prompt)
        assert (out.logits[i] - ref).abs().max() <= 0.05 * ref.abs().max()
        assert int(out.next_tokens[i]) == int(ref.argmax())


def _edited(model_dir: Path, target: Path, **fields: Any) -> Path:
    shutil.copytree(model_dir, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **fields}))
    return target


_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
         "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}


@pytest.mark.parametrize("fields, named", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"rope_parameters": _ROPE}, "rope_parameters['full_attention'].rope_type='dynamic'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ({"hidden_activation": "gelu"}, "hidden_act='gelu'"),
])
def test_a_gemma3_field_that_is_not_implemented_is_refused_by_name(
        tiny_gemma3_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        fields: dict[str, Any], named: str) -> None:
    """Refused before any weight is read."""
    def load_model(*args: object) -> None:
        raise AssertionError("the weights loaded before the config was checked")

    model_dir = _edited(tiny_gemma3_dir, tmp_path / "model", **fields)
    monkeypatch.setattr("asyncinfer.engine.runner.ModelRunner._load_model", load_model)
    with pytest.raises(UnsupportedModelError, match=re.escape(named)):
        LLM(str(model_dir), skip_tokenizer_init=True, dtype="float32", num_pages=64,
            max_seq_len=256)


def test_gemma3_on_two_ranks_matches_transformers(tiny_gemma3_dir: Path) -> None:
    """``--tp 2`` on CPU (gloo): heads, KV heads, MLP and vocabulary split; the replicated
    (1 + w) and q/k norms and the embedding scale give transformers' tokens."""
    prompts, expected = reference(tiny_gemma3_dir)
    assert generate_ids(tiny_gemma3_dir, prompts, tensor_parallel_size=2) == expected


@pytest.mark.parametrize("cuda_graph", [True, False])
def test_gemma3_through_the_flashinfer_host_path_matches_transformers(
        tiny_gemma3_dir: Path, monkeypatch: pytest.MonkeyPatch, cuda_graph: bool) -> None:
    """The flashinfer backend's host side on a CPU (kernels stood in for), decode and
    prefill through padded graphs: flashinfer gets query_pre_attn_scalar's scale."""
    import tests.fake_flashinfer as fake_flashinfer
    from asyncinfer.attention.flashinfer_backend import FlashInferBackend

    monkeypatch.setattr("asyncinfer.attention.flashinfer_backend.load_flashinfer",
                        lambda device: fake_flashinfer)
    prompts, expected = reference(tiny_gemma3_dir)
    llm = LLM(str(tiny_gemma3_dir), skip_tokenizer_init=True, dtype="float32",
              max_seq_len=256, num_pages=600, attention_backend="flashinfer",
              cuda_graph=cuda_graph, max_running_requests=5, cuda_graph_max_bs=6)
    assert isinstance(llm.runner.backend, FlashInferBackend)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected
    if llm.runner.graphs is not None:
        assert sum(g.replays for g in llm.runner.graphs.decode) > 0
