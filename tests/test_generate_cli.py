"""`asyncinfer generate` on the embedded model, and seeded sampling through the runner."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncinfer.api import LLM
from asyncinfer.cli import main
from asyncinfer.config import EngineConfig
from asyncinfer.errors import ConfigError, InvalidRequestError
from asyncinfer.params import SamplingParams


def test_generate_names_paris(smollm2_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "The capital of France is", "--max-tokens", "8",
                 "--temperature", "0"])
    assert code == 0
    assert "Paris" in capsys.readouterr().out


def test_generate_reports_bad_options_as_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--max-tokens", "0"]) == 2
    assert "max_tokens must be" in capsys.readouterr().err


def test_seeded_request_samples_the_same_tokens_in_any_batch(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), skip_tokenizer_init=True, dtype="float32",
              max_running_requests=4, num_pages=64, max_seq_len=128)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234,
                            ignore_eos=True)
    prompt = [7, 8, 9, 10, 11]
    [alone] = llm.generate([prompt], seeded, use_tqdm=False)
    others = [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.7, seed=99, ignore_eos=True)]
    batch = llm.generate([[3, 4], [50] * 30, prompt, [1, 2, 3]],
                         [others[0], others[1], seeded, others[2]], use_tqdm=False)
    assert batch[2].token_ids == alone.token_ids


@pytest.mark.parametrize("options", [
    {"page_size": 0}, {"dtype": "int8"}, {"device": "tpu"}, {"kv_cache_gb": -1},
    {"load_format": "pickle"},
])
def test_bad_engine_options_are_config_errors(options: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        EngineConfig(**options)  # type: ignore[arg-type]


@pytest.mark.parametrize("options", [
    {"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5},
    {"min_p": 2.0}, {"top_k": 1.5}, {"seed": "x"}, {"stop": [""]}, {"max_tokens": True},
])
def test_bad_sampling_values_are_invalid_requests(options: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**options)  # type: ignore[arg-type]


def test_prompt_longer_than_context_finishes_with_a_clear_error(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), skip_tokenizer_init=True, dtype="float32",
              max_running_requests=2, num_pages=64, max_seq_len=32)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    too_long, fine = llm.generate([[5] * 40, [5] * 20], params, use_tqdm=False)
    assert too_long.finish_reason == "error"
    assert too_long.error is not None
    assert "40 tokens" in too_long.error and "32" in too_long.error
    assert too_long.token_ids == []
    # max_tokens is clamped to what the context leaves: 32 - 20.
    assert fine.finish_reason == "length" and len(fine.token_ids) == 12
