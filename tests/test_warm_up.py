"""The CPU engine's start-up forward (engine.warm_up): its plan fits the pool, the context
and the rows; it commits the pool's first pages and leaves no trace in what requests get."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncinfer.api.llm import LLM
from asyncinfer.engine.warm_up import ROWS, warm_up_plan
from asyncinfer.params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


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
        # The rows are as the scheduler expects to find them; the first page is written
        # only where the warm-up ran.
        assert not runner.page_table.any() and not runner.token_pool.any()
        pools.append(bool(runner.pool.k[0, :runner.page_size].any()))
        outputs.append([o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
        llm.close()
    assert pools == [False, True]
    assert outputs[0] == outputs[1] and all(len(ids) == 6 for ids in outputs[0])


