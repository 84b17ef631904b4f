"""The FP8 KV cache (``kv_cache_dtype``): the option and its refusals, the pool's size and
saturating store, how far it moves the logits of the tiny models (teacher-forced, against
the model's own cache), the flashinfer backend's host path over FP8 pages (through
tests/fake_flashinfer.py) against the torch backend, and the Triton store kernel under the
interpreter against the torch store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from benchmarks.kv_quality import compare

import tests.fake_flashinfer as fake_flashinfer
from asyncinfer.api import LLM
from asyncinfer.attention.flashinfer_backend import FlashInferBackend
from asyncinfer.attention.xqa_decode import XqaDecode, block_tables
from asyncinfer.config import EngineConfig
from asyncinfer.errors import ConfigError
from asyncinfer.kvcache.pool import FP8_DTYPES, narrow, store_kv
from tests.test_model_outputs import GREEDY, reference
from tests.triton_interpreter import run_interpreted

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_the_option_names_its_formats_and_refuses_others() -> None:
    assert EngineConfig().kv_cache_torch_dtype is None
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_torch_dtype is E4M3
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_torch_dtype is E4M3
    assert EngineConfig(kv_cache_dtype="fp8_e5m2").kv_cache_torch_dtype is E5M2
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_the_store_saturates_where_a_plain_cast_would_not(dtype: torch.dtype) -> None:
    limit = FP8_DTYPES[dtype]
    x = torch.tensor([3 * limit, -3 * limit, 1.5, 0.0])
    assert narrow(x, dtype).float().tolist() == [limit, -limit, 1.5, 0.0]
    cache = torch.zeros(4, 1, 4, dtype=dtype)
    store_kv(cache, cache.clone(), torch.tensor([2]), x.view(1, 1, 4), x.view(1, 1, 4))
    assert cache[2, 0].float().tolist() == [limit, -limit, 1.5, 0.0]
    assert cache[[0, 1, 3]].float().abs().sum() == 0
    # what saturation is for: a plain cast to e5m2 past its range is infinite
    if dtype is E5M2:
        assert x.to(dtype).float()[0].isinf()


def test_batch_invariant_refuses_an_fp8_cache_by_name(tiny_llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match="kv_cache_dtype 'fp8_e4m3'"):
        LLM(str(tiny_llama_dir), skip_tokenizer_init=True, dtype="float32",
            batch_invariant=True, kv_cache_dtype="fp8_e4m3", num_pages=64)


@pytest.mark.parametrize("kv_cache_dtype, stored", [("fp8", E4M3), ("fp8_e5m2", E5M2)])
def test_the_same_budget_holds_four_times_the_float32_pages(
        tiny_llama_dir: Path, kv_cache_dtype: str, stored: torch.dtype) -> None:
    options: dict[str, object] = {"dtype": "float32", "kv_cache_gb": 0.01,
                                  "max_seq_len": 256, "skip_tokenizer_init": True}
    plain = LLM(str(tiny_llama_dir), **options)
    fp8 = LLM(str(tiny_llama_dir), kv_cache_dtype=kv_cache_dtype, **options)
    assert plain.runner.pool.k.dtype == torch.float32
    assert fp8.runner.pool.k.dtype == fp8.runner.pool.v.dtype == stored
    assert fp8.runner.pool.k.element_size() == 1
    # the extra page a capturable backend keeps aside, four times the pages
    assert abs(fp8.runner.num_pages - 4 * plain.runner.num_pages) <= 4
    out = fp8.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)[0]
    assert len(out.token_ids) == GREEDY.max_tokens


def test_the_comparison_finds_no_error_between_two_equal_caches(tiny_llama_dir: Path) -> None:
    """The harness's control: the model's own cache against itself."""
    same = compare(tiny_llama_dir, "auto", dtype="float32", sequences=2, length=40)
    assert same["positions"] == 2 * 24
    assert same["top1_agreement"] == 1.0 and same["max_abs_logit_error"] == 0.0


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_fp8_moves_the_logits_little_and_e4m3_less_than_e5m2(
        request: pytest.FixtureRequest, model: str) -> None:
    """Teacher-forced over 2 x 64 positions in bf16: e4m3's 3 mantissa bits against e5m2's
    2, no value near either format's range."""
    model_dir = request.getfixturevalue(model)
    e4m3 = compare(model_dir, "fp8_e4m3", sequences=2, length=80)
    e5m2 = compare(model_dir, "fp8_e5m2", sequences=2, length=80)
    assert e4m3["positions"] == 2 * 64
    assert max(e4m3["reference_k_absmax"], e4m3["reference_v_absmax"]) < 448
    assert e4m3["top1_agreement"] >= 0.85
    assert e4m3["max_error_over_logit_range"] < 0.1
    assert 0 < e4m3["mean_abs_logit_error"] < e5m2["mean_abs_logit_error"]


@pytest.fixture
def fake_fi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("asyncinfer.attention.flashinfer_backend.load_flashinfer",
                        lambda device: fake_flashinfer)


@pytest.mark.usefixtures("fake_fi")
@pytest.mark.parametrize(("kv_cache_dtype", "xqa_device", "cuda_graph"), [
    ("fp8_e4m3", False, True), ("fp8_e4m3", True, True), ("fp8_e4m3", True, False),
    ("fp8_e5m2", True, True)])
def test_flashinfer_over_fp8_pages_gives_the_torch_backends_tokens(
        tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch, kv_cache_dtype: str,
        xqa_device: bool, cuda_graph: bool) -> None:
    """Planned with the pages' dtype (the stand-in refuses pages of another), decode and
    prefill read FP8 pages back as the torch backend does: the same greedy tokens. Where
    XQA runs (``xqa_device``: a GPU it is built for, stood in for here) decode batches of
    e4m3 pages take it, eager and graphed; e5m2 pages stay with the decode wrapper."""
    monkeypatch.setattr("asyncinfer.attention.xqa_decode.supported_device",
                        lambda device: xqa_device)
    # The real XQA takes half-precision queries; the stand-in computes in float32 too.
    monkeypatch.setattr("asyncinfer.attention.xqa_decode.XQA_QUERY_DTYPES", (torch.float32,))
    prompts, _ = reference(tiny_qwen3_dir)
    options: dict[str, object] = {"dtype": "float32", "max_running_requests": 5,
                                  "max_seq_len": 256, "num_pages": 600,
                                  "kv_cache_dtype": kv_cache_dtype, "skip_tokenizer_init": True}
    torch_llm = LLM(str(tiny_qwen3_dir), attention_backend="torch", **options)
    fi_llm = LLM(str(tiny_qwen3_dir), attention_backend="flashinfer", cuda_graph=cuda_graph,
                 cuda_graph_max_bs=6, **options)
    backend = fi_llm.runner.backend
    assert isinstance(backend, FlashInferBackend)
    assert backend.xqa == (xqa_device and kv_cache_dtype == "fp8_e4m3")
    assert all(isinstance(w, XqaDecode) == backend.xqa for w in backend.decode.values())
    want = [o.token_ids for o in torch_llm.generate(prompts, GREEDY, use_tqdm=False)]
    got = [o.token_ids for o in fi_llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want
    graphs = fi_llm.runner.graphs
    if cuda_graph:
        assert graphs is not None and sum(g.replays for g in graphs.decode) > 0
        for g in graphs.decode:
            assert all(isinstance(w, XqaDecode) == backend.xqa
                       for w in g.context.meta.wrappers.values())


def test_xqa_block_tables_list_each_rows_pages_then_the_padding() -> None:
    page_table = torch.arange(4 * 64, dtype=torch.int32).view(4, 64).flip(0).contiguous()
    tables = block_tables(page_table, [2, 0], page_size=16, pad_rows=2, pad_page=99)
    assert tables.dtype == torch.int32 and tables.shape == (4, 4)
    assert tables[0].tolist() == [4, 5, 6, 7] and tables[1].tolist() == [12, 13, 14, 15]
    assert tables[2:].eq(99).all()


_TRITON_STORE_CHECK = """
import itertools

import torch
from asyncinfer.kvcache.pool import FP8_DTYPES as FP8_MAX
from asyncinfer.layers import fused, triton_ops

torch.manual_seed(0)
heads, kv_heads, dim, tokens = 4, 2, 16, 5
# without Qwen3's norm (norm False) the large key row saturates too
for dtype, norm in itertools.product((torch.float8_e4m3fn, torch.float8_e5m2), (True, False)):
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim) * 3
    qkv[1, -dim:] *= 1e5  # a value row past either format's range: saturated
    qkv[2, heads * dim:] *= 1e5  # and a key row
    cos, sin = torch.rand(tokens, 1, dim), torch.rand(tokens, 1, dim)
    q_w, k_w = (torch.rand(dim) + 0.5, torch.rand(dim) + 0.5) if norm else (None, None)
    slots = torch.tensor([7, 0, 3, 12, 9])
    caches = [torch.zeros(16, kv_heads, dim, dtype=dtype) for _ in range(4)]
    ours = triton_ops.qk_norm_rope_store(qkv, cos, sin, q_w, k_w, 1e-6, heads, kv_heads,
                                         dim, caches[0], caches[1], slots)
    theirs = fused.qk_norm_rope_store(qkv, cos, sin, q_w, k_w, 1e-6, heads, kv_heads, dim,
                                      caches[2], caches[3], slots)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
        a, b = a.float(), b.float()
        assert not a.isnan().any() and not a.isinf().any()
        # The same slots and saturated values; elsewhere the interpreter's own rounding to
        # FP8 slips now and then (it loses the carry into the exponent, so a value just
        # below a power of two comes out at half of it, and rounds subnormals down; a GPU
        # rounds as torch does): equal, or of one sign within a factor of 2, or subnormal.
        assert ((a == 0) == (b == 0)).all()
        assert (a.abs() == FP8_MAX[dtype]).eq(b.abs() == FP8_MAX[dtype]).all()
        near = (a * b > 0) & (a.abs() <= 2 * b.abs()) & (b.abs() <= 2 * a.abs())
        assert ((a == b) | near | (b.abs() < 2 ** -6)).all()
        assert (a == b).float().mean() > 0.95
    assert caches[1].float().abs().max() == caches[3].float().abs().max() == FP8_MAX[dtype]
    if not norm:
        assert caches[0].float().abs().max() == FP8_MAX[dtype]
print("checked")
"""


def test_the_triton_store_writes_fp8_as_the_torch_store_does() -> None:
    """The CUDA store kernel under Triton's interpreter (its own process), with rows past the
    formats' range: saturated alike, and elsewhere the same values (but for the interpreter's
    own rounding slip, named in the check)."""
    assert "checked" in run_interpreted(_TRITON_STORE_CHECK, "the store kernel")
