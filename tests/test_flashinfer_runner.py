"""The runner with the flashinfer backend, its host side on a CPU: paged layouts, graph
padding, prompt uploads, chunked extend over cached prefixes, with a stand-in for
flashinfer's kernels (tests/fake_flashinfer.py). Token-exact with transformers in float32.
The real kernels are checked against the torch backend on the GPU
(tests/gpu/test_gpu_engine.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tests.fake_flashinfer as fake_flashinfer
from asyncinfer.api import LLM
from asyncinfer.attention.flashinfer_backend import (
    FlashInferBackend,
    host_lengths,
    load_flashinfer,
    paged_layout,
)
from asyncinfer.attention.registry import BACKENDS, backend_class
from asyncinfer.attention.torch_backend import TorchBackend
from asyncinfer.engine.cuda_graph import DecodeGraphs, batch_size_ladder
from asyncinfer.errors import ConfigError
from tests.test_llm import cases
from tests.test_model_outputs import GREEDY, reference


@pytest.fixture
def fake_fi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("asyncinfer.attention.flashinfer_backend.load_flashinfer",
                        lambda device: fake_flashinfer)


def fi_llm(model_dir: Path, **options: object) -> LLM:
    defaults: dict[str, object] = {"dtype": "float32", "max_running_requests": 8,
                                   "max_seq_len": 256, "num_pages": 600,
                                   "attention_backend": "flashinfer"}
    return LLM(str(model_dir), skip_tokenizer_init=True, **{**defaults, **options})


def test_flashinfer_needs_cuda() -> None:
    with pytest.raises(ConfigError, match="CUDA"):
        load_flashinfer(torch.device("cpu"))


def test_backends_come_from_the_registry() -> None:
    assert dict(BACKENDS) == {"torch": TorchBackend, "flashinfer": FlashInferBackend}
    assert backend_class("flashinfer") is FlashInferBackend
    assert FlashInferBackend.capturable and not TorchBackend.capturable
    with pytest.raises(ConfigError, match="unknown attention backend"):
        backend_class("sdpa")


def test_flashinfer_without_float32_kernels_is_refused_before_loading(
        monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path) -> None:
    class NoFloat32:
        pass

    def load_model(*args: object) -> None:
        raise AssertionError("the model loaded before the backend was checked")

    monkeypatch.setattr("asyncinfer.attention.flashinfer_backend.load_flashinfer",
                        lambda device: NoFloat32)
    monkeypatch.setattr("asyncinfer.engine.runner.ModelRunner._load_model", load_model)
    with pytest.raises(ConfigError, match="float32"):
        fi_llm(tiny_llama_dir)


def test_decode_graphs_refuse_a_backend_that_cannot_be_captured(tiny_llama_dir: Path) -> None:
    llm = fi_llm(tiny_llama_dir, attention_backend="torch")
    runner = llm.runner
    assert isinstance(runner.backend, TorchBackend) and runner.graphs is None
    assert runner.scratch_page is None  # no page held back for graph padding
    with pytest.raises(ConfigError, match="cannot be captured"):
        DecodeGraphs(runner.backend, lambda ids, pos, attn: ids, runner.token_pool, 4,
                     pad_index=0, pad_slot=0, device=runner.device)


def test_batch_size_ladder() -> None:
    assert batch_size_ladder(1) == [1]
    assert batch_size_ladder(8) == [1, 2, 4, 8]
    assert batch_size_ladder(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_size_ladder(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_paged_layout_reads_pages_off_the_table() -> None:
    page = 4
    table = torch.zeros(3, 17, dtype=torch.int64)
    table[0, :12] = torch.tensor([8, 9, 10, 11, 20, 21, 22, 23, 4, 5, 6, 7])  # pages 2, 5, 1
    table[2, :4] = torch.tensor([12, 13, 14, 15])                              # page 3
    layout = paged_layout(table, [0, 2], [9, 3], page, pad_to=4, pad_page=7)
    assert layout.indptr.tolist() == [0, 3, 4, 5, 6]
    assert layout.indices.tolist() == [2, 5, 1, 3, 7, 7]
    assert layout.last_page_len.tolist() == [1, 3, 1, 1]
    assert layout.seq_lens.tolist() == [9, 3, 1, 1]
    assert all(t.dtype == torch.int32 for t in (layout.indptr, layout.indices,
                                                 layout.last_page_len))


@pytest.mark.usefixtures("fake_fi")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("cuda_graph", [True, False])
def test_greedy_matches_transformers(tiny_qwen3_dir: Path, page_size: int,
                                     cuda_graph: bool) -> None:
    prompts, expected = reference(tiny_qwen3_dir)
    # Five rows at a time: decode batches of 5 and 3 replay the padded sizes 6 and 4.
    llm = fi_llm(tiny_qwen3_dir, page_size=page_size, cuda_graph=cuda_graph,
                 max_running_requests=5, cuda_graph_max_bs=6)
    assert isinstance(llm.runner.backend, FlashInferBackend)
    assert (llm.runner.graphs is not None) == cuda_graph
    got = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected
    if llm.runner.graphs is not None:  # decode batches went through the padded graph path
        metas = [c.meta for c in llm.runner.graphs.contexts.values()]
        assert sum(m.wrapper.plans for m in metas) > 0
        # every size plans into the same layout buffers, and out_loc is the graph's own
        assert len({m.wrapper.buffers[1].data_ptr() for m in metas}) == 1
        assert all(m.out_loc.data_ptr() == llm.runner.graphs.inputs[2].data_ptr()
                   for m in metas)


@pytest.mark.usefixtures("fake_fi")
@pytest.mark.parametrize("overlap", [True, False])
def test_chunked_extend_over_cached_prefixes(tiny_llama_dir: Path, overlap: bool) -> None:
    """Small chunks, a radix cache and varied lengths: every path of the runner, and the
    scratch page and row stay out of the scheduler's hands."""
    prompts, max_tokens, expected = cases(tiny_llama_dir)
    from asyncinfer.params import SamplingParams

    llm = fi_llm(tiny_llama_dir, page_size=4, max_extend_tokens=24, cuda_graph_max_bs=2,
                 overlap=overlap, num_pages=200)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in max_tokens]
    for _ in range(2):  # the second pass extends over pages the first left in the cache
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected
    llm.scheduler.check_invariants()
    assert llm.runner.scratch_page == llm.runner.num_pages


def test_host_lengths_iterate_as_numpy_and_stay_tensors() -> None:
    lens = torch.tensor([5, 900, 3], dtype=torch.int32)
    fast = host_lengths(lens)
    assert isinstance(fast, torch.Tensor) and fast.data_ptr() == lens.data_ptr()
    # What flashinfer's plan does with them on the host.
    assert max(fast.cpu()).item() == 900
    assert max(fast.to("cpu")[1:] - fast.to("cpu")[:-1]).item() == 895
    assert torch.equal(fast.cpu().flatten(), lens)


@pytest.mark.usefixtures("fake_fi")
def test_closed_engine_is_collected_though_it_froze_the_heap(tiny_llama_dir: Path) -> None:
    import gc
    import weakref

    gc.unfreeze()
    try:
        # The CUDA runner sits in reference cycles (its graphs call back into it), which
        # only the collector frees: a frozen heap would keep its KV pool, on a GPU most of
        # the device's memory, from whatever the process runs next.
        llm = fi_llm(tiny_llama_dir, freeze_gc=True)
        assert gc.get_freeze_count() > 0
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
        pool = weakref.ref(llm.runner.pool.k)
        llm.close()
        del llm
        gc.collect()
        assert pool() is None
    finally:
        gc.unfreeze()
