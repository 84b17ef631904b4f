"""The runner with the flashinfer backend, its host side on a CPU: paged layouts, decode and
prefill graph padding (replayed eagerly here, on the same padded buffers), prompt uploads,
chunked extend over cached prefixes, with a stand-in for flashinfer's kernels
(tests/fake_flashinfer.py). Token-exact with transformers in float32. The real kernels are
checked against the torch backend on the GPU (tests/gpu/test_gpu_engine.py)."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

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
from asyncinfer.config import AttentionBackend
from asyncinfer.core import Batch
from asyncinfer.engine.cuda_graph import CudaGraphs, batch_size_ladder, token_count_ladder
from asyncinfer.engine.runner import ModelRunner
from asyncinfer.errors import ConfigError
from tests.test_llm import cases
from tests.test_model_outputs import GREEDY, reference

# Prompt lengths of table rows 0..7 in ``runner_batches``.
RUNNER_PROMPT_LENS = [70, 5, 57, 20, 40, 64, 130, 210]


def runner_batches() -> list[Batch]:
    """Batches straight to the runner over rows holding prompts of ``RUNNER_PROMPT_LENS``
    (every position a batch reads was written before: a prompt, or a sampled token)."""
    def batch(rows: list[int], starts: list[int], ends: list[int],
              sample: list[bool] | None = None) -> Batch:
        return Batch(rows=rows, starts=starts, ends=ends, params=[GREEDY] * len(rows),
                     steps=[0] * len(rows), sample=sample or [True] * len(rows))

    return [
        # three prompts, row 0's first chunk only (it samples nothing)
        batch([0, 1, 2], [0, 0, 0], [30, 5, 57], [False, True, True]),
        # row 0's last chunk over its cached 30 tokens; row 3's first chunk
        batch([0, 3], [30, 0], [70, 10], [True, False]),
        # rows 1 and 2 decode beside row 3's last chunk and a new prompt
        batch([1, 2, 3, 4], [5, 57, 10, 0], [6, 58, 20, 40]),
        # exactly a captured token count: no padding token
        batch([5], [0], [64]),
        # a decode batch
        batch([0, 1, 2, 3, 4], [70, 6, 58, 20, 40], [71, 7, 59, 21, 41]),
        # a prompt and a decoding request in a larger graph
        batch([6, 0], [0, 71], [130, 72]),
        # past the largest captured token count: eager either way
        batch([7], [0], [210]),
    ]


def place_prompts(runner: ModelRunner, prompts: list[list[int]]) -> None:
    """Give table row ``i`` a block of pages of its own and prompt ``i``."""
    span = -(-runner.width // runner.page_size) * runner.page_size
    assert len(prompts) * span <= runner.num_pages * runner.page_size
    for row, prompt in enumerate(prompts):
        runner.page_table[row] = torch.arange(row * span, row * span + runner.width)
        runner.write_prompt(row, prompt)


def graph_and_eager(graphed: ModelRunner, eager: ModelRunner, prompts: list[list[int]]
                    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Run ``runner_batches`` on both runners: (tokens, logits) of each, batch by batch."""
    assert graphed.graphs is not None and eager.graphs is None
    place_prompts(graphed, prompts)
    place_prompts(eager, prompts)
    results = []
    for batch in runner_batches():
        ours, theirs = graphed.forward(batch), eager.forward(batch)
        results.append((ours.next_tokens.clone(), ours.logits.float().cpu(),
                        theirs.next_tokens.clone(), theirs.logits.float().cpu()))
    return results


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


def test_every_backend_the_option_offers_is_registered_and_others_are_refused() -> None:
    """The flag's choices and the registry agree, so every offered backend can be built."""
    offered = set(get_args(AttentionBackend)) - {"auto"}
    assert offered == set(BACKENDS)
    with pytest.raises(ConfigError, match="unknown attention backend 'sdpa'") as refused:
        backend_class("sdpa")
    assert all(name in str(refused.value) for name in offered)


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


def test_graphs_refuse_a_backend_that_cannot_be_captured(tiny_llama_dir: Path) -> None:
    llm = fi_llm(tiny_llama_dir, attention_backend="torch")
    runner = llm.runner
    assert isinstance(runner.backend, TorchBackend) and runner.graphs is None
    assert runner.scratch_page is None  # no page held back for graph padding
    with pytest.raises(ConfigError, match="cannot be captured"):
        CudaGraphs(runner.backend, lambda ids, pos, attn, last: ids, runner.token_pool, 4, 64,
                   pad_index=0, pad_slot=0, device=runner.device)


def test_batch_size_ladder() -> None:
    assert batch_size_ladder(1) == [1]
    assert batch_size_ladder(8) == [1, 2, 4, 8]
    assert batch_size_ladder(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_size_ladder(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_token_count_ladder() -> None:
    assert token_count_ladder(24) == [24]
    assert token_count_ladder(64) == [64]
    assert token_count_ladder(100) == [64, 100]
    assert token_count_ladder(2048) == [64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    assert token_count_ladder(3000) == [64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048,
                                        3000]


@pytest.mark.usefixtures("fake_fi")
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("max_requests", [64, 3])
def test_prefill_graph_padding_equals_eager(tiny_llama_dir: Path, page_size: int,
                                            max_requests: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts, chunks over cached prefixes and decoding requests mixed with prompts, through
    the padded prefill graphs (token counts 64, 128, 192, 200) and eagerly: the same logits
    and tokens. With 3 requests a graph, a batch of 3 fills every row but the padding one
    and a batch of 4 runs eagerly."""
    monkeypatch.setattr("asyncinfer.engine.cuda_graph.PREFILL_MAX_REQUESTS", max_requests)
    pages = 8 * -(-257 // page_size) + 1
    options: dict[str, object] = {"page_size": page_size, "num_pages": pages,
                                  "max_extend_tokens": 200}
    graphed_llm = fi_llm(tiny_llama_dir, **options)
    eager_llm = fi_llm(tiny_llama_dir, cuda_graph=False, **options)
    graphed, eager = graphed_llm.runner, eager_llm.runner
    assert graphed.graphs is not None
    assert graphed.graphs.prefill_sizes == [64, 128, 192, 200]
    assert [g.shape.rows for g in graphed.graphs.prefill] == [min(max_requests, t - 1) + 1
                                                               for t in (64, 128, 192, 200)]
    generator = torch.Generator().manual_seed(page_size)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist()
               for n in RUNNER_PROMPT_LENS]
    for ours, our_logits, theirs, their_logits in graph_and_eager(graphed, eager, prompts):
        assert torch.equal(ours, theirs)
        torch.testing.assert_close(our_logits, their_logits, rtol=1e-5, atol=1e-5)
    replays = [g.replays for g in graphed.graphs.prefill]
    # 5 prefill batches fit (4 with 3 requests a graph), the one of 210 tokens does not
    assert sum(replays) == (5 if max_requests == 64 else 4)
    assert replays[0] == (3 if max_requests == 64 else 2) and replays[2] == 1
    assert sum(g.replays for g in graphed.graphs.decode) == 1


@pytest.mark.usefixtures("fake_fi")
def test_graphs_are_picked_by_phase_requests_and_tokens(tiny_llama_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setattr("asyncinfer.engine.cuda_graph.PREFILL_MAX_REQUESTS", 4)
    graphs = fi_llm(tiny_llama_dir, max_extend_tokens=300, cuda_graph_max_bs=6).runner.graphs
    assert graphs is not None

    def picked(phase: str, requests: int, tokens: int) -> tuple[str, int, int] | None:
        graph = graphs.pick(phase, requests, tokens)  # type: ignore[arg-type]
        return None if graph is None else (graph.shape.phase, graph.shape.rows,
                                           graph.shape.tokens)

    assert picked("decode", 3, 3) == ("decode", 4, 4)
    assert picked("decode", 7, 7) is None
    assert picked("prefill", 1, 2) == ("prefill", 5, 64)
    assert picked("prefill", 4, 65) == ("prefill", 5, 128)
    assert picked("prefill", 5, 65) is None           # one row is the padding request's
    assert picked("prefill", 1, 300) == ("prefill", 5, 300)
    assert picked("prefill", 1, 301) is None
    decode_only = fi_llm(tiny_llama_dir, cuda_graph_max_prefill_tokens=0).runner.graphs
    assert decode_only is not None and decode_only.prefill == []


def test_paged_layout_reads_pages_off_the_table() -> None:
    page = 4
    table = torch.zeros(3, 17, dtype=torch.int64)
    table[0, :12] = torch.tensor([8, 9, 10, 11, 20, 21, 22, 23, 4, 5, 6, 7])  # pages 2, 5, 1
    table[2, :4] = torch.tensor([12, 13, 14, 15])                              # page 3
    layout = paged_layout(table, [0, 2], [9, 3], page, pad_lens=[1, 1], pad_page=7)
    assert layout.indptr.tolist() == [0, 3, 4, 5, 6]
    assert layout.indices.tolist() == [2, 5, 1, 3, 7, 7]
    assert layout.last_page_len.tolist() == [1, 3, 1, 1]
    assert layout.seq_lens.tolist() == [9, 3, 1, 1]
    # A padding request longer than a page reads the pad page again.
    layout = paged_layout(table, [2], [3], page, pad_lens=[1, 9], pad_page=7)
    assert layout.indptr.tolist() == [0, 1, 2, 5]
    assert layout.indices.tolist() == [3, 7, 7, 7, 7]
    assert layout.last_page_len.tolist() == [3, 1, 1]
    assert layout.seq_lens.tolist() == [3, 1, 9]
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
    graphs = llm.runner.graphs
    if graphs is not None:  # decode and prefill batches went through the padded graph path
        assert sum(g.replays for g in graphs.decode) > 0
        assert sum(g.replays for g in graphs.prefill) > 0
        metas = [g.context.meta for g in [*graphs.decode, *graphs.prefill]]
        # every graph plans into the same layout buffers, and out_loc is the graphs' own
        assert len({m.wrapper.buffers[1].data_ptr() for m in metas}) == 1
        assert all(m.out_loc.data_ptr() == graphs.inputs[2].data_ptr() for m in metas)


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
