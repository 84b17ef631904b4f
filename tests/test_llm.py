"""``LLM.generate`` through the scheduler: token-exact with transformers for every built-in
policy, cache type and chunked-prefill setting; plugins; prefix reuse; clamping."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from asyncinfer.api import LLM
from asyncinfer.params import SamplingParams
from tests.hf_reference import hf_greedy, load_hf

POLICIES = [("prefill_first", {}), ("decode_first", {"max_decode_rounds": 2}),
            ("skip_ahead", {"aging": 1.0, "threshold": 4.0})]
_CASES: dict[str, tuple[list[list[int]], list[int], list[list[int]]]] = {}


def cases(model_dir: Path) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Sixteen prompts (some sharing prefixes) with varied max_tokens, and HF's outputs."""
    key = str(model_dir)
    if key not in _CASES:
        rng = random.Random(7)
        shared = [rng.randrange(3, 500) for _ in range(20)]
        prompts = []
        for i in range(16):
            head = shared[: rng.randrange(4, 20)] if i % 3 == 0 else []
            prompts.append(head + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 70))])
        max_tokens = [rng.randrange(1, 20) for _ in prompts]
        hf = load_hf(model_dir)
        _CASES[key] = prompts, max_tokens, [
            hf_greedy(hf, p, n) for p, n in zip(prompts, max_tokens)]
    return _CASES[key]


def tiny_llm(model_dir: Path, **options: object) -> LLM:
    defaults: dict[str, object] = {
        "dtype": "float32", "page_size": 4, "max_running_requests": 4, "num_pages": 80,
        "max_seq_len": 128}
    return LLM(str(model_dir), skip_tokenizer_init=True, **{**defaults, **options})


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("policy, options", POLICIES, ids=[p for p, _ in POLICIES])
@pytest.mark.parametrize("cache_type", ["naive", "radix"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_generate_is_token_exact_with_transformers(
    tiny_llama_dir: Path, policy: str, options: dict[str, object], cache_type: str,
    chunked: bool,
) -> None:
    prompts, max_tokens, expected = cases(tiny_llama_dir)
    llm = tiny_llm(tiny_llama_dir, policy=policy, policy_options=options, cache_type=cache_type,
                   chunked_prefill=chunked, max_extend_tokens=24 if chunked else 128)
    outputs = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)
    sched = llm.scheduler
    assert not sched.has_work
    assert sched.kv.allocator.num_free + sched.kv.cached_pages == llm.runner.num_pages


def test_lpm_with_chunked_prefill_and_radix_is_token_exact_with_transformers(
    tiny_llama_dir: Path,
) -> None:
    """Every prompt twice, so the second copies find the first ones' pages and lpm
    reorders the queue by what matches."""
    prompts, max_tokens, expected = cases(tiny_llama_dir)
    llm = tiny_llm(tiny_llama_dir, policy="lpm", policy_options={"max_wait_rounds": 4},
                   cache_type="radix", chunked_prefill=True, max_extend_tokens=24)
    outputs = llm.generate(prompts * 2, [greedy(n) for n in max_tokens * 2], use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected * 2
    assert llm.policy.name == "lpm" and llm.scheduler.kv.stats.hits > len(prompts) // 2
    sched = llm.scheduler
    assert not sched.has_work
    assert sched.kv.allocator.num_free + sched.kv.cached_pages == llm.runner.num_pages


def test_qwen3_through_the_scheduler_is_token_exact(tiny_qwen3_dir: Path) -> None:
    prompts, max_tokens, expected = cases(tiny_qwen3_dir)
    llm = tiny_llm(tiny_qwen3_dir, policy="skip_ahead", max_extend_tokens=32)
    outputs = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected


def test_plugin_policy_is_found_by_entry_point_and_drives_generation(
    tiny_llama_dir: Path,
) -> None:
    from asyncinfer.policies.registry import available_policies

    assert "shortest_prompt_first" in available_policies()
    prompts, max_tokens, expected = cases(tiny_llama_dir)
    llm = tiny_llm(tiny_llama_dir, policy="shortest_prompt_first",
                   policy_options={"max_wait_rounds": 5}, max_extend_tokens=40)
    assert llm.policy.name == "shortest_prompt_first"
    outputs = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected


def test_policy_overlap_and_policy_options_are_engine_config(tiny_llama_dir: Path) -> None:
    from asyncinfer.errors import ConfigError
    from asyncinfer.policies import SkipAhead

    llm = tiny_llm(tiny_llama_dir, policy="decode_first",
                   policy_options={"max_decode_rounds": 2}, overlap=False)
    assert (llm.config.policy, dict(llm.config.policy_options), llm.config.overlap) == (
        "decode_first", {"max_decode_rounds": 2}, False)
    assert llm.policy.name == "decode_first" and llm.engine.overlap is False
    # A Policy instance is used as given; the config records its name.
    instance = SkipAhead(aging=0.5)
    llm = tiny_llm(tiny_llama_dir, policy=instance)
    assert llm.policy is instance and llm.config.policy == "skip_ahead"
    assert llm.config.overlap is True and dict(llm.config.policy_options) == {}
    prompts, max_tokens, expected = cases(tiny_llama_dir)
    outputs = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
    with pytest.raises(ConfigError, match="policy instance"):
        tiny_llm(tiny_llama_dir, policy=instance, policy_options={"aging": 1.0})


def test_radix_cache_computes_only_the_uncached_suffix(tiny_llama_dir: Path) -> None:
    rng = random.Random(11)
    shared = [rng.randrange(3, 500) for _ in range(30)]
    first = [*shared, 9, 9, 9]
    second = [*shared, 7, 7, 7, 7, 7]
    hf = load_hf(tiny_llama_dir)
    llm = tiny_llm(tiny_llama_dir, cache_type="radix", page_size=4)
    [out1] = llm.generate([first], greedy(6), use_tqdm=False)
    computed_before = llm.scheduler.tokens_computed
    [out2] = llm.generate([second], greedy(6), use_tqdm=False)
    computed = llm.scheduler.tokens_computed - computed_before
    assert out2.cached_tokens == 28  # 30 shared tokens, in whole pages of 4
    # The uncached suffix of the prompt once, then one token per further output token.
    assert computed == (len(second) - 28) + (6 - 1)
    assert out1.token_ids == hf_greedy(hf, first, 6)
    assert out2.token_ids == hf_greedy(hf, second, 6)


def test_naive_cache_recomputes_the_whole_prompt(tiny_llama_dir: Path) -> None:
    llm = tiny_llm(tiny_llama_dir, cache_type="naive")
    llm.generate([[5] * 30], greedy(2), use_tqdm=False)
    [out] = llm.generate([[5] * 30 + [6]], greedy(2), use_tqdm=False)
    assert out.cached_tokens == 0


def test_text_prompts_and_stop_strings(smollm2_dir: Path) -> None:
    llm = LLM(None, dtype="float32", max_running_requests=2)
    [out] = llm.generate("The capital of France is",
                         SamplingParams(max_tokens=20, temperature=0.0, stop=["."]),
                         use_tqdm=False)
    assert out.text == " Paris"
    assert out.finish_reason == "stop"
    assert out.prompt == "The capital of France is"
    assert out.metrics is not None and out.metrics.first_token_time is not None
    assert not llm.scheduler.has_work and not llm.scheduler.running


def _captured_bar(monkeypatch: pytest.MonkeyPatch, mininterval: float) -> list[str]:
    """Make ``LLM.generate``'s bar write into a list (one entry per print, ANSI-free) and
    refresh at most every ``mininterval`` seconds."""
    import functools
    import io

    import tqdm.auto

    frames: list[str] = []

    class Frames(io.StringIO):
        def write(self, text: str) -> int:
            if text.strip("\r\n\x1b[A "):
                frames.append(text)
            return len(text)

    monkeypatch.setattr(tqdm.auto, "tqdm", functools.partial(
        tqdm.auto.tqdm, file=Frames(), mininterval=mininterval, ascii=True))
    return frames


def _shown(frames: list[str]) -> list[tuple[int, int]]:
    """(requests done, output tokens) of every printed frame of the bar."""
    import re

    shown = []
    for frame in frames:
        match = re.search(r"(\d+)/\d+ .*out=(\d+) tok, [\d.]+ tok/s", frame)
        if match:
            shown.append((int(match[1]), int(match[2])))
    return shown


def test_progress_bar_shows_output_tokens_as_they_arrive(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Eight requests, four slots: no request ends before many tokens have been generated.
    frames = _captured_bar(monkeypatch, mininterval=0.0)
    llm = tiny_llm(tiny_llama_dir, max_running_requests=4)
    prompts = [[3 + i, 40 + i, 70 + i, 9] for i in range(8)]
    outputs = llm.generate(prompts, greedy(24))
    total = sum(len(o.token_ids) for o in outputs)
    assert total == 8 * 24
    shown = _shown(frames)
    assert shown[-1] == (8, total)
    # The token count moved while no request had finished, and it never went back.
    assert any(done == 0 and 0 < tokens < total for done, tokens in shown)
    assert any(0 < tokens < total for _, tokens in shown[:-1])
    assert [t for _, t in shown] == sorted(t for _, t in shown)


def test_progress_bar_refreshes_at_a_bounded_rate(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With an interval longer than the run, the bar prints its start and its end only,
    # however many tokens arrive; the end still has the exact count.
    frames = _captured_bar(monkeypatch, mininterval=3600.0)
    llm = tiny_llm(tiny_llama_dir, max_running_requests=4)
    outputs = llm.generate([[5, 6, 7, i] for i in range(8)], greedy(16))
    assert len(frames) <= 2
    assert _shown(frames)[-1] == (8, sum(len(o.token_ids) for o in outputs))
    # Without the bar nothing is printed and outputs are the same.
    assert [o.token_ids for o in llm.generate([[5, 6, 7, i] for i in range(8)], greedy(16),
                                               use_tqdm=False)] == [o.token_ids for o in outputs]


def test_the_model_is_built_and_run_on_one_thread_of_its_own(
        tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU, loading the weights and every batch run on one thread, not the caller's:
    a second thread starting OpenMP regions would slow every region (see
    api.async_engine._compute_thread). A restarted engine runs on a new thread."""
    import threading

    from asyncinfer.api import async_engine
    from asyncinfer.engine.runner import ModelRunner

    built: list[threading.Thread] = []  # the thread objects: an ident may be reused
    ran: list[threading.Thread] = []
    create = async_engine.create_runner

    def create_runner(*args, **kwargs):
        built.append(threading.current_thread())
        return create(*args, **kwargs)

    forward = ModelRunner._forward_here

    def forward_here(self, batch):
        ran.append(threading.current_thread())
        return forward(self, batch)

    monkeypatch.setattr(async_engine, "create_runner", create_runner)
    monkeypatch.setattr(ModelRunner, "_forward_here", forward_here)
    llm = LLM(str(tiny_llama_dir), skip_tokenizer_init=True, num_pages=64)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    first = llm.generate([[1, 2, 3], [4, 5]], params, use_tqdm=False)
    assert all(len(o.token_ids) == 3 for o in first)
    assert len(built) == 1 and built[0] is not threading.current_thread()
    assert ran and set(ran) == set(built)
    llm._loop.run_until_complete(llm.engine.close())  # stopped; the next call starts again
    ran.clear()
    again = llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert again[0].token_ids == first[0].token_ids
    assert ran and len(set(ran)) == 1 and set(ran) != set(built)
    llm.close()
    names = {t.name for t in threading.enumerate()}
    assert not any(n.startswith("asyncinfer-compute") for n in names)


def test_an_llm_left_open_at_exit_closes_quietly(tiny_llama_dir: Path) -> None:
    """A script that never calls close(): the engine is closed as the interpreter exits,
    after Python has ended the executors' threads; the device is synchronized inline
    then, and nothing is reported as an error."""
    import subprocess
    import sys

    script = ("from asyncinfer.api import LLM\n"
              "from asyncinfer.params import SamplingParams\n"
              f"llm = LLM({str(tiny_llama_dir)!r}, skip_tokenizer_init=True, num_pages=64)\n"
              "out = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3, "
              "temperature=0.0, ignore_eos=True), use_tqdm=False)\n"
              "print(sum(len(o.token_ids) for o in out))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "6"
    assert "Traceback" not in done.stderr and "died" not in done.stderr, done.stderr
