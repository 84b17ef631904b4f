"""The CPU engine's start-up forward (engine.warm_up): its plan fits the pool, the context
and the rows; it commits the pool's first pages in every layer, runs one layer, and leaves
no trace in what requests get."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest
import torch

from asyncinfer.api.llm import LLM
from asyncinfer.engine.warm_up import ROWS, warm_up_plan
from asyncinfer.params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def resident(tensor: torch.Tensor) -> bool:
    """Whether every memory page under ``tensor`` (contiguous) is resident (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = tensor.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    pages = -(-length // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, \
        ctypes.get_errno()
    return all(v & 1 for v in vec)


@pytest.mark.parametrize(("tokens", "rows", "context", "pages", "page"), [
    (4096, 256, 8192, 512, 16), (4096, 256, 8192, 100, 16), (4096, 2, 300, 512, 16),
    (4096, 256, 2, 512, 16), (10, 256, 8192, 512, 16), (4096, 256, 8192, 1, 16),
    (4096, 20, 255, 8192, 1), (7, 3, 5, 2, 4)])
def test_the_plan_fits_its_rows_context_and_pages(tokens: int, rows: int, context: int,
                                                   pages: int, page: int) -> None:
    count, per = warm_up_plan(tokens, rows, context, pages, page)
    assert 1 <= count <= min(rows, ROWS) and 1 <= per <= context - 1
    assert count * per <= tokens
    assert count * -(-(per + 1) // page) <= pages  # each row's pages its own
    # As many tokens as the limits allow, up to ``tokens``: no row or page left unused
    # where one more would fit.
    assert count * per == tokens or per == context - 1 or count == min(rows, ROWS, pages) \
        or count * -(-(per + 2) // page) > pages


def test_the_plan_is_empty_where_no_token_fits() -> None:
    assert warm_up_plan(4096, 256, 8192, 1, 1) == (0, 0)   # a page for the sampled token
    assert warm_up_plan(4096, 0, 8192, 512, 16) == (0, 0)
    assert warm_up_plan(0, 16, 8192, 512, 16) == (0, 0)


def test_the_warm_up_commits_the_first_pages_and_changes_no_output(
        tiny_llama_dir: Path) -> None:
    prompts = [[5 + i, 17, 3 * i + 2, 99, 42] for i in range(5)]
    outputs, pools = [], []
    for warm in (False, True):
        llm = LLM(str(tiny_llama_dir), skip_tokenizer_init=True, dtype="float32",
                  max_running_requests=4, max_seq_len=128, warm_up=warm)
        runner = llm.runner
        # The rows are as the scheduler expects to find them, the model has all its layers
        # again, and the first page of every layer's K and V is resident only where the
        # warm-up ran.
        assert not runner.page_table.any() and not runner.token_pool.any()
        assert len(runner.model.layers) == runner.model_config.num_layers > 1
        page = runner.page_size
        pools.append([resident(cache[layer, :page]) for cache in (runner.pool.k, runner.pool.v)
                      for layer in range(runner.model_config.num_layers)])
        outputs.append([o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
        llm.close()
    assert not any(pools[0]) and all(pools[1])
    assert outputs[0] == outputs[1] and all(len(ids) == 6 for ids in outputs[0])


def test_first_layers_runs_the_forward_through_those_layers_only(
        tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), skip_tokenizer_init=True, dtype="float32",
              max_running_requests=4, max_seq_len=128, warm_up=False)
    model = llm.runner.model
    calls: list[int] = []
    hooks = [layer.register_forward_hook(lambda module, args, out, i=i: calls.append(i))
             for i, layer in enumerate(model.layers)]
    with model.first_layers(1):
        assert len(model.layers) == 1
        llm.generate([[5, 17, 2, 99]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert set(calls) == {0}
    calls.clear()
    llm.generate([[5, 17, 2, 99]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert set(calls) == set(range(len(model.layers))) and len(model.layers) > 1
    for hook in hooks:
        hook.remove()
    llm.close()
