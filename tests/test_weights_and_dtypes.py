"""Weights load from sharded safetensors, GGUF (cached once) and dummy; every dtype runs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from asyncinfer.api import LLM
from asyncinfer.config import EngineConfig
from asyncinfer.core import Batch
from asyncinfer.engine.runner import ModelRunner
from asyncinfer.models import source
from asyncinfer.params import SamplingParams
from tests.hf_reference import hf_greedy, hf_last_logits, load_hf, place_rows

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def runner_for(model_dir: Path, **options: object) -> ModelRunner:
    config = EngineConfig(**{"dtype": "float32", "max_running_requests": 4, "num_pages": 64,
                             "max_seq_len": 256, **options})  # type: ignore[arg-type]
    return ModelRunner(config, model_dir)


def test_sharded_checkpoint_loads_and_matches_transformers(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    hf = load_hf(tiny_llama_dir)
    hf.save_pretrained(tmp_path, max_shard_size="200KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    prompt = [5, 17, 42, 99, 3]
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32", num_pages=64)
    [out] = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert out.token_ids == hf_greedy(hf, prompt, 16)


def test_a_tied_checkpoint_without_a_head_gives_transformers_logits(tiny_qwen3_dir: Path) -> None:
    from asyncinfer.models.weights import iter_safetensors

    assert not any("lm_head" in name for name, _ in iter_safetensors(tiny_qwen3_dir))
    runner = runner_for(tiny_qwen3_dir)
    prompt = [7, 300, 41, 2, 99, 18]
    place_rows(runner, [prompt])
    out = runner.forward(Batch(rows=[0], starts=[0], ends=[6], params=[GREEDY], steps=[0]))
    ref = hf_last_logits(load_hf(tiny_qwen3_dir), prompt)
    assert (out.logits[0] - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_dummy_weights_have_real_shapes_and_give_finite_logits(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), skip_tokenizer_init=True, load_format="dummy", num_pages=64)
    runner = llm.runner
    hf_shapes = {n: tuple(p.shape) for n, p in load_hf(tiny_llama_dir).named_parameters()}
    ours = dict(runner.model.named_parameters())
    assert tuple(ours["embed_tokens.weight"].shape) == hf_shapes["model.embed_tokens.weight"]
    q, k, v = (hf_shapes[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    qkv = runner.model.get_submodule("layers.0.self_attn.qkv_proj")
    # On a CPU without bf16 units a float32 shadow, or a copy packed for our AVX2 kernel,
    # has taken the bf16 weight's place.
    if qkv.shadow is not None:
        shape = tuple(qkv.shadow[0].shape)
    elif qkv.weight.numel() == 0:
        shape = (qkv.packed.out_features, qkv.packed.data.numel() // qkv.packed.out_features)
    else:
        shape = tuple(qkv.weight.shape)
    assert shape == (q[0] + k[0] + v[0], q[1])
    [out] = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert len(out.token_ids) == 16


@pytest.mark.parametrize("fp32_kernels", ["on", "off"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_logits_are_close_to_transformers(
    tiny_llama_dir: Path, dtype: str, fp32_kernels: str
) -> None:
    torch_dtype = getattr(torch, dtype)
    runner = runner_for(tiny_llama_dir, dtype=dtype, cpu_fp32_compute=fp32_kernels)
    assert runner.config.fp32_kernels == (fp32_kernels == "on")
    hf = load_hf(tiny_llama_dir, dtype=torch_dtype)
    rng = random.Random(3)
    prompt = [rng.randrange(3, 500) for _ in range(40)]
    ref = hf_last_logits(hf, prompt)
    place_rows(runner, [prompt])
    out = runner.forward(Batch(rows=[0], starts=[0], ends=[40], params=[GREEDY], steps=[0]))
    assert runner.pool.k.dtype == (torch.float32 if fp32_kernels == "on" else torch_dtype)
    assert runner.model.layers[0].mlp.gate_up_proj.weight.dtype == torch_dtype
    assert (out.logits[0] - ref).abs().max() <= 0.05 * ref.abs().max()
    assert int(out.next_tokens[0]) == int(ref.argmax())


def test_gguf_file_is_converted_once_and_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCINFER_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    calls: list[Path] = []

    def fake_convert(src: Path, target: Path) -> None:
        calls.append(src)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")

    monkeypatch.setattr("asyncinfer.models.convert.convert_gguf", fake_convert)
    first = source.resolve_model(str(gguf))
    second = source.resolve_model(str(gguf))
    assert first == second and calls == [gguf]
    assert first in source.cached_models()


@pytest.mark.parametrize("name, message", [
    ("/nonexistent/model", "neither a model directory nor a .gguf file"),
    ("/nonexistent/model.gguf", "does not exist"),
    ("no-such-org/no-such-model", "could not be reached"),
])
def test_unresolvable_models_are_clear_errors(name: str, message: str) -> None:
    with pytest.raises(source.ModelNotFoundError, match=message):
        source.resolve_model(name)


def test_embedded_model_is_the_default(smollm2_dir: Path) -> None:
    assert source.resolve_model(None) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").exists()
    assert (smollm2_dir / "tokenizer.json").exists()
