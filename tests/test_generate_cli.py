"""`asyncinfer generate` on the embedded model, seeded sampling through the runner, and the
engine options: declared once on EngineConfig, the commands' flags generated from them."""

from __future__ import annotations

import importlib
import subprocess
import sys
import typing
from pathlib import Path

import attrs
import pytest

from asyncinfer.api import LLM
from asyncinfer.cli import build_parser, main
from asyncinfer.config import OPTION, EngineConfig, OptionInfo
from asyncinfer.errors import ConfigError, InvalidRequestError
from asyncinfer.options import engine_option_names, engine_options
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
    {"load_format": "pickle"}, {"cache_type": "lru"}, {"attention_backend": "xformers"},
    {"cpu_fp32_compute": "yes"}, {"gpu_memory_utilization": 1.5}, {"policy": ""},
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


# ---- engine options: one declaration, every command's flags --------------------------------


def test_every_engine_option_is_declared_with_help_and_its_choices_are_its_type() -> None:
    hints = typing.get_type_hints(EngineConfig)
    for field in attrs.fields(EngineConfig):
        info = field.metadata.get(OPTION)
        assert isinstance(info, OptionInfo) and info.help, field.name
        literal = typing.get_args(hints[field.name]) if typing.get_origin(
            hints[field.name]) is typing.Literal else None
        assert info.choices == literal, field.name


def _subparser(*path: str) -> typing.Any:
    if path[0] == "benchmarks":  # a benchmark driver's own parser (repository's benchmarks/)
        module = importlib.import_module(f"benchmarks.{path[1]}")
        return module.build_parser()
    parser: typing.Any = build_parser()
    for name in path:
        [sub] = [a for a in parser._actions if a.dest in ("command", "bench")]
        parser = sub.choices[name]
    return parser


@pytest.mark.parametrize("command, left_out", [
    (("serve",), set()), (("bench", "offline"), set()), (("benchmarks", "offline"), set()),
    (("benchmarks", "decode"), set()),
    (("generate",), set()),
])
def test_commands_take_the_engine_options_from_the_config(
    command: tuple[str, ...], left_out: set[str],
) -> None:
    parser = _subparser(*command)
    declared = parser.get_default("engine_option_names")
    assert set(engine_option_names()) - set(declared) == left_out
    by_dest = {a.dest: a for a in parser._actions}
    for field in attrs.fields(EngineConfig):
        if field.name in left_out:
            continue
        action = by_dest[field.name]
        assert action.default is None  # unset: the engine's default applies
        assert action.choices == field.metadata[OPTION].choices or action.choices is None


def test_boolean_options_take_both_spellings_and_given_flags_build_a_valid_config() -> None:
    parser = build_parser()
    args = parser.parse_args([
        "serve", "--model", "m", "--device", "cuda:1", "--dtype", "fp16", "--load-format",
        "dummy", "--page-size", "32", "--max-running-requests", "8", "--max-seq-len", "512",
        "--kv-cache-gb", "1.5", "--kv-cache-dtype", "fp8_e5m2", "--num-pages", "100",
        "--seed", "7", "--cache-type", "naive",
        "--cpu-fp32-compute", "off", "--no-cpu-kernels", "--cpu-threads", "3",
        "--no-batch-invariant",
        "--max-extend-tokens", "256", "--kv-events", "tcp://*:5557",
        "--chunked-prefill", "--no-warm-up",
        "--gpu-memory-utilization", "0.8", "--attention-backend", "torch", "--cuda-graph",
        "--cuda-graph-max-bs", "4", "--cuda-graph-max-prefill-tokens", "512", "--tp", "1",
        "--tp-guard-interval", "4",
        "--no-torch-compile", "--freeze-gc", "--policy",
        "decode_first", "--policy-opt", "max_decode_rounds=2", "--overlap"])
    options = engine_options(args)
    assert set(options) == set(engine_option_names())
    config = EngineConfig(**options)
    assert (config.chunked_prefill, config.cuda_graph, config.torch_compile, config.freeze_gc,
            config.overlap) == (True, True, False, True, True)
    assert config.policy_options == {"max_decode_rounds": 2} and not config.warm_up
    assert config.kv_events == "tcp://*:5557"
    assert config.kv_cache_gb == 1.5 and config.num_pages == 100 and config.seed == 7
    assert config.cuda_graph_max_prefill_tokens == 512 and config.tp_guard_interval == 4
    assert config.cpu_kernels is False and config.batch_invariant is False
    assert config.cpu_threads == 3 and config.kv_cache_dtype == "fp8_e5m2"
    hash(config)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--cache-type", "lru"])


def test_generate_takes_the_engines_seed_and_policy() -> None:
    args = build_parser().parse_args(["generate", "hi", "--seed", "3", "--no-overlap",
                                      "--policy", "decode_first", "--policy-opt",
                                      "max_decode_rounds=2"])
    assert engine_options(args) == {"seed": 3, "overlap": False, "policy": "decode_first",
                                    "policy_options": {"max_decode_rounds": 2}}


def test_a_malformed_policy_option_is_a_config_error() -> None:
    args = build_parser().parse_args(["serve", "--policy-opt", "aging"])
    with pytest.raises(ConfigError, match="malformed policy option"):
        engine_options(args)


@pytest.mark.parametrize("command", [
    [], ["serve"], ["generate"], ["bench"], ["bench", "serve"], ["policies"], ["models"],
], ids=lambda c: " ".join(c) or "asyncinfer")
def test_help_imports_no_torch(command: list[str]) -> None:
    script = ("import sys\n"
              "from asyncinfer.cli import main\n"
              "try:\n"
              f"    main({[*command, '--help']!r})\n"
              "except SystemExit as exc:\n"
              "    assert exc.code == 0, exc.code\n"
              "assert 'torch' not in sys.modules, 'torch imported'\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: asyncinfer" in done.stdout


def test_serve_flags_are_generated_from_the_server_options(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, every server flag is its option's default; given, its value, checked."""
    from asyncinfer.server.options import ServerOptions

    monkeypatch.delenv("ASYNCINFER_API_KEY", raising=False)
    parser = build_parser()
    assert ServerOptions.from_args(parser.parse_args(["serve"])) == ServerOptions()
    args = parser.parse_args(["serve", "--port", "0", "--max-tokens-limit", "7",
                              "--special-tokens-in-text", "--router-policy", "random"])
    assert ServerOptions.from_args(args) == ServerOptions(
        port=0, max_tokens_limit=7, special_tokens_in_text=True, router_policy="random")
    with pytest.raises(ConfigError, match="--body-timeout must be more than 0 seconds"):
        ServerOptions.from_args(parser.parse_args(["serve", "--body-timeout", "0"]))
    monkeypatch.setenv("ASYNCINFER_API_KEY", "k")
    assert ServerOptions.from_args(build_parser().parse_args(["serve"])).api_key == "k"


@pytest.mark.parametrize(("dp", "runs"), [(1, "one server"), (3, "replicas")])
def test_serve_runs_replicas_only_with_dp(dp: int, runs: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncinfer.server.main
    import asyncinfer.server.replicas

    ran = []
    monkeypatch.setattr(asyncinfer.server.main, "serve", lambda args: ran.append("one server"))
    monkeypatch.setattr(asyncinfer.server.replicas, "serve_replicas",
                        lambda args: ran.append("replicas"))
    args = build_parser().parse_args(["serve", "--dp", str(dp)])
    args.func(args)
    assert ran == [runs]


@pytest.mark.parametrize(("argv", "usage", "suggestion"), [
    (["serve", "--max-token", "5"], "asyncinfer serve", "--max-tokens-limit"),
    (["bench", "serve", "--rat", "3"], "asyncinfer bench serve", "--rate"),
    (["generate", "hi", "--temprature", "0.5"], "asyncinfer generate", "--temperature"),
])
def test_a_flag_is_never_abbreviated_and_an_unknown_one_gets_its_commands_usage(
        argv: list[str], usage: str, suggestion: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {usage} ")
    assert f"unrecognized arguments: {' '.join(argv[-2:])} (did you mean {suggestion}?)" in err
