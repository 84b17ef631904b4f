"""Mistral's sliding window is token-exact with transformers on every attention path: the
torch backend (SDPA and the CPU kernels), chunked prefill, prefix-cache hits, batches of
many lengths, and flashinfer's host path with the CPU stand-in planned with ``window_left``."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from asyncinfer.api import LLM
from asyncinfer.params import SamplingParams
from tests.conftest import _save_tiny
from tests.hf_reference import hf_greedy, load_hf
from tests.test_cpu_kernels import BUILDS, _build, _case, _prefill_case, _prefill_kernels

WINDOW = 16
NEW_TOKENS = 40     # prompts of 41 to 70 tokens: prompt + output >= 5x the window


def _tiny_mistral(path: Path, window: int | None = WINDOW) -> Path:
    from transformers import MistralConfig

    config = MistralConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, eos_token_id=1, bos_token_id=0, sliding_window=window,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return _save_tiny(config, path)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer random Mistral (GQA 8/2) whose window of 16 is shorter than every prompt."""
    return _tiny_mistral(tmp_path_factory.mktemp("tiny-mistral"))


def window_prompts(seed: int = 3) -> list[list[int]]:
    """Ten prompts of 41 to 70 tokens; three share a 45-token prefix (radix hits past the
    window), and two short ones ride in the same batches."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 512) for _ in range(45)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (1, 9, 25)]
    prompts += [[rng.randrange(3, 512) for _ in range(n)] for n in (41, 47, 52, 58, 70)]
    prompts += [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 12)]
    return prompts


_REFERENCE: dict[str, list[list[int]]] = {}


def expected(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    key = str(model_dir)
    if key not in _REFERENCE:
        hf = load_hf(model_dir)
        _REFERENCE[key] = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    return _REFERENCE[key]


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def generate(model_dir: Path, prompts: list[list[int]], **options: Any) -> list[list[int]]:
    options = {"skip_tokenizer_init": True, "dtype": "float32", "max_running_requests": 16,
               "max_seq_len": 256, **options}
    llm = LLM(str(model_dir), **options)
    try:
        return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.close()


@pytest.mark.parametrize("options", [
    {"cpu_kernels": False, "page_size": 16},
    {"cpu_kernels": False, "page_size": 4, "max_extend_tokens": 6},
    {"cpu_kernels": True, "page_size": 16},
    {"cpu_kernels": True, "page_size": 1, "max_extend_tokens": 20},
], ids=["sdpa", "sdpa-chunked", "kernels", "kernels-chunked"])
def test_mistral_window_matches_transformers(mistral_dir: Path, options: dict[str, Any]) -> None:
    prompts = window_prompts()
    assert generate(mistral_dir, prompts, **options) == expected(mistral_dir, prompts)


def test_prefix_cache_hits_past_the_window_match_transformers(mistral_dir: Path) -> None:
    """A second round over the same engine finds the prompts cached (pages behind the
    window included) and still gives transformers' tokens."""
    prompts = window_prompts()
    llm = LLM(str(mistral_dir), skip_tokenizer_init=True, dtype="float32",
              max_running_requests=16, max_seq_len=256, page_size=4)
    try:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        again = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.close()
    want = expected(mistral_dir, prompts)
    assert [o.token_ids for o in first] == want
    assert [o.token_ids for o in again] == want
    assert all(o.cached_tokens >= len(p) - 4 for o, p in zip(again, prompts))


def test_a_null_window_runs_as_plain_attention(tmp_path: Path) -> None:
    model_dir = _tiny_mistral(tmp_path / "full", window=None)
    prompts = window_prompts(seed=4)[:4]
    hf = load_hf(model_dir)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert generate(model_dir, prompts, cpu_kernels=False) == want


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_flashinfer_host_path_plans_window_left(mistral_dir: Path, cuda_graph: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Through flashinfer's CPU stand-in, which attends by the ``window_left`` it was planned
    with: every wrapper (eager and graph) planned with window - 1, transformers' tokens."""
    import tests.fake_flashinfer as fake_flashinfer

    monkeypatch.setattr("asyncinfer.attention.flashinfer_backend.load_flashinfer",
                        lambda device: fake_flashinfer)
    prompts = window_prompts()
    llm = LLM(str(mistral_dir), skip_tokenizer_init=True, dtype="float32",
              max_running_requests=6, max_seq_len=256, num_pages=600, page_size=4,
              max_extend_tokens=48, attention_backend="flashinfer", cuda_graph=cuda_graph,
              cuda_graph_max_bs=8)
    try:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        backend, graphs = llm.runner.backend, llm.runner.graphs
        wrappers = [*backend.prefill.values(), *backend.decode.values()]
        if graphs is not None:
            wrappers = [w for g in [*graphs.decode, *graphs.prefill]
                        for w in g.context.meta.wrappers.values()]
            assert sum(g.replays for g in graphs.decode) > 0
            assert sum(g.replays for g in graphs.prefill) > 0
    finally:
        llm.close()
    assert got == expected(mistral_dir, prompts)
    assert any(w.plans for w in wrappers)
    assert {w.window_left for w in wrappers if w.plans} == {WINDOW - 1}


def _windowed(n: int, start: int, window: int) -> torch.Tensor:
    """[n, start + n]: query i (position start + i) sees keys start + i - window + 1 .. it."""
    ones = torch.ones(n, start + n, dtype=torch.bool)
    return ones.tril(diagonal=start) & ~ones.tril(diagonal=start - window)


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (6, 2, 48)])
@pytest.mark.parametrize("window", [1, 16, 37])
def test_decode_kernel_reads_only_the_window(march: str, dtype: torch.dtype, heads: int,
                                             kv_heads: int, dim: int, window: int) -> None:
    """Lengths 1 .. 70 around the window (blocked and plain head sizes): SDPA over each
    request's last ``window`` keys. Keys before the window are poisoned: never read."""
    kernels = _build(march)
    q, k, v, table, rows, lens = _case(dtype, heads, kv_heads, dim)
    for i in range(q.shape[0]):  # NaN in every key and value behind the window
        behind = table[rows[i], : max(0, int(lens[i]) - window)]
        k[behind], v[behind] = float("nan"), float("nan")
    out = kernels.decode_attention(q, k, v, table, rows, lens, dim**-0.5, int(lens.max()),
                                   window)
    for i in range(q.shape[0]):
        slots = table[rows[i], max(0, int(lens[i]) - window): lens[i]]
        want = F.scaled_dot_product_attention(
            q[i].unsqueeze(1), k[slots].float().transpose(0, 1),
            v[slots].float().transpose(0, 1), scale=dim**-0.5, enable_gqa=True).squeeze(1)
        torch.testing.assert_close(out[i], want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 128)])
@pytest.mark.parametrize("window", [1, 16, 50, 100])
def test_amx_prefill_kernel_masks_the_window(heads: int, kv_heads: int, dim: int,
                                             window: int) -> None:
    """Prompts and cached prefixes longer and shorter than the window: as close to float32
    SDPA under the windowed mask as torch's bf16 SDPA is."""
    kernels = _prefill_kernels()
    starts, news = [0, 5, 140, 0, 16, 0], [70, 3, 100, 1, 17, 300]
    q, k, v, slots, index = _prefill_case(starts, news, heads, kv_heads, dim)
    out = kernels.prefill_attention(q, k, v, *index, dim**-0.5, window)

    def sdpa(dtype: torch.dtype) -> torch.Tensor:
        outs, lo = [], 0
        for sl, start, n in zip(slots, starts, news):
            qr = q[lo:lo + n].transpose(0, 1)[None].to(dtype)
            lo += n
            kr, vr = (t[sl].transpose(0, 1)[None].to(dtype) for t in (k, v))
            outs.append(F.scaled_dot_product_attention(
                qr, kr, vr, attn_mask=_windowed(n, start, window), scale=dim**-0.5,
                enable_gqa=True)[0].transpose(0, 1))
        return torch.cat(outs).float()

    exact = sdpa(torch.float32)
    ours, theirs = (out.float() - exact).abs(), (sdpa(torch.bfloat16) - exact).abs()
    assert ours.max() <= 1.25 * theirs.max() + 1e-3 and ours.mean() <= 1.05 * theirs.mean()
