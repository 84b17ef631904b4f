"""Each family added beside Llama and Qwen3 through `asyncinfer serve`: concurrent prompts
longer than the window, chunked, each sent twice so that the second copy hits the radix
cache, and every answer equal to transformers' greedy tokens (float32)."""

from __future__ import annotations

import asyncio
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.hf_reference import hf_greedy, load_hf
from tests.test_gemma3 import _tiny_gemma3
from tests.test_moe import _tiny_qwen3_moe
from tests.test_phi3 import tiny_phi3
from tests.test_sliding_window import _tiny_mistral, window_prompts

NEW_TOKENS = 40


def _tiny_mixtral(path: Path) -> Path:
    from transformers import MixtralConfig

    from tests.conftest import _save_tiny

    config = MixtralConfig(
        vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=1024, tie_word_embeddings=False,
        eos_token_id=1, bos_token_id=0, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    return _save_tiny(config, path)


FAMILIES: dict[str, Callable[[Path], Path]] = {
    "mistral": _tiny_mistral,
    "phi3": tiny_phi3,
    "gemma3": _tiny_gemma3,
    "qwen3_moe": lambda path: _tiny_qwen3_moe(path, norm_topk_prob=True, mlp_only_layers=[1]),
    "mixtral": _tiny_mixtral,
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_each_family_serves_transformers_tokens(
        family: str, smollm2_dir: Path, tmp_path: Path) -> None:
    """The server needs a tokenizer: SmolLM2's is copied beside the random weights (the
    prompts are token ids below the tiny vocabulary, so only their detokenized text uses
    it)."""
    import aiohttp

    from tests.test_server_process import start_server

    model_dir = FAMILIES[family](tmp_path / family)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, model_dir / name)
    prompts = window_prompts()
    hf = load_hf(model_dir)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    del hf

    proc, url = start_server(model_dir, "--chunked-prefill", "--max-extend-tokens", "16",
                             "--page-size", "4", "--cache-type", "radix")
    try:
        async with aiohttp.ClientSession() as session:
            async def one(prompt: list[int]) -> list[int]:
                body = {"input_ids": prompt, "sampling_params": {
                    "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}}
                async with session.post(f"{url}/generate", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    data = await resp.json()
                return list(data["token_ids"])

            got = await asyncio.gather(*(one(p) for p in prompts + prompts))
            async with session.get(f"{url}/metrics") as resp:
                metrics = await resp.text()
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    assert list(got) == expected + expected
    hits = next(line for line in metrics.splitlines()
                if line.startswith("asyncinfer_prefix_cache_hits"))
    assert float(hits.split()[-1]) > 0
