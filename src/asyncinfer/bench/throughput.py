"""`asyncinfer bench offline`: tokens per second of ``LLM.generate`` over a fixed workload."""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

# The --help text.
DESCRIPTION = """\
Two workloads, drawn the same way on every run: ``cpu`` (64 prompts of 32..512 random ids,
32..256 tokens each, greedy) and ``gpu`` (nano-vllm's bench: 256 prompts of 100..1024 ids,
100..1024 tokens each, temperature 0.6). EOS never ends a request early, so every run
generates the same number of tokens. ``--shape`` runs a known model shape with dummy
weights, for a model that is not on the machine. Engine options (``--tp``, ``--policy``,
``--device`` ...) are the engine's flags.
"""

# Model shapes (their config.json, shape only) for runs with dummy weights.
_QWEN3_0_6B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "tie_word_embeddings": True, "attention_bias": False, "hidden_act": "silu",
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16"}
_QWEN3_30B_A3B: dict[str, Any] = {
    **_QWEN3_0_6B, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": _QWEN3_0_6B,
    "qwen3-8b": {**_QWEN3_0_6B, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32,
                 "tie_word_embeddings": False},
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    # The CPU MoE workload's model: 8 layers of 16 experts (top 4) of width 256 over 512,
    # 32k vocabulary: 89M weights, 50M of them experts, 13M of those used per token.
    "qwen3-moe-tiny": {**_QWEN3_30B_A3B, "vocab_size": 32000, "hidden_size": 512,
                       "intermediate_size": 1024, "moe_intermediate_size": 256,
                       "num_hidden_layers": 8, "num_attention_heads": 8,
                       "num_key_value_heads": 4, "head_dim": 64, "num_experts": 16,
                       "num_experts_per_tok": 4, "bos_token_id": 0, "eos_token_id": 1},
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32000,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "sliding_window": 4096, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"},
}

# Per workload: (requests, prompt lengths, output lengths), temperature, engine defaults.
OFFLINE_WORKLOADS: dict[str, tuple[tuple[int, tuple[int, int], tuple[int, int]], float,
                           dict[str, Any]]] = {
    "cpu": ((64, (32, 512), (32, 256)), 0.0,
            {"max_running_requests": 64, "max_seq_len": 2048}),
    "gpu": ((256, (100, 1024), (100, 1024)), 0.6,
            {"device": "cuda", "max_running_requests": 256, "max_seq_len": 2048,
             "max_extend_tokens": 16384}),
}


# The engine options whose defaults the workloads set, as the flags' help says them.
DEFAULTS_HERE = {
    "device": "cpu on the cpu workload, cuda on the gpu one",
    "max_running_requests": "64 on the cpu workload, 256 on the gpu one",
    "max_extend_tokens": "the engine's on cpu, 16384 on gpu",
    "max_seq_len": "2048",
    "load_format": "auto; dummy with --shape"}


def shape_dir(name: str, root: Path) -> Path:
    """A model directory holding only the config.json of a known shape."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(SHAPES[name], indent=2))
    return path


def offline_workload(name: str) -> tuple[list[list[int]], list[int]]:
    """A workload's prompts (token ids) and max_tokens, ``random.Random(0)``'s draws as in
    nano-vllm's bench: cpu's are 64 prompts of 32..512 ids, 9,896 tokens in all."""
    (n, prompt_len, output_len), _, _ = OFFLINE_WORKLOADS[name]
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(*prompt_len))]
               for _ in range(n)]
    return prompts, [rng.randint(*output_len) for _ in range(n)]


def run_offline(model: str, options: dict[str, Any], prompts: list[list[int]],
                max_tokens: list[int], temperature: float) -> dict[str, Any]:
    """Start an LLM, warm it up, then time one ``generate`` over the whole workload."""
    from asyncinfer.api import LLM
    from asyncinfer.params import SamplingParams

    start = time.perf_counter()
    llm = LLM(model, skip_tokenizer_init=True, **options)
    startup = time.perf_counter() - start
    try:
        llm.generate([p[:64] for p in prompts[:4]],
                     SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True),
                     use_tqdm=False)
        params = [SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True)
                  for n in max_tokens]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        failed = [o.error for o in outputs if o.error]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
        tokens = sum(len(o.token_ids) for o in outputs)
        return {"engine": "asyncinfer", "tokens": tokens, "seconds": round(seconds, 3),
                "tokens_per_s": round(tokens / seconds, 1), "startup_s": round(startup, 1),
                "tensor_parallel_size": llm.config.tensor_parallel_size,
                "options": options, "policy": llm.policy.name}
    finally:
        llm.close()


# The CPU features a CPU figure depends on (which kernels and GEMMs run).
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
             "amx_fp16")


def machine() -> dict[str, Any]:
    """The CPU a result came from (model, ``CPU_FLAGS`` it has, usable cores): CPU figures
    compare only on the same kind."""
    import os

    from asyncinfer.kernels.cpu import cpu_flags

    name = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.partition(":")[2].strip() for line in f
                         if line.startswith("model name")), name)
    except OSError:
        pass
    flags = set(cpu_flags().partition(":")[2].split())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": name, "cpu_flags": [f for f in CPU_FLAGS if f in flags], "cores": cores}


def main(args: argparse.Namespace) -> int:
    """``asyncinfer bench offline``."""
    from asyncinfer.config import EngineConfig
    from asyncinfer.models.source import resolve_model
    from asyncinfer.options import engine_options

    _, default_temperature, defaults = OFFLINE_WORKLOADS[args.workload]
    options: dict[str, Any] = {**defaults, **engine_options(args)}
    model = options.pop("model", None)
    if args.shape:
        options.setdefault("load_format", "dummy")
        model_dir = shape_dir(args.shape, Path(tempfile.mkdtemp()))
    else:
        model_dir = resolve_model(model)
    config = EngineConfig(**options)  # every option checked before the model loads
    prompts, max_tokens = offline_workload(args.workload)
    temperature = default_temperature if args.temperature is None else args.temperature
    result = run_offline(str(model_dir), options, prompts, max_tokens, temperature)
    report = {"benchmark": f"offline-{args.workload}", "model": model_dir.name,
              "weights": config.load_format, "dtype": config.dtype, "device": config.device,
              "requests": len(prompts), "temperature": temperature, "machine": machine(),
              **result}
    print(f"asyncinfer bench offline: {result['tokens']} tokens in {result['seconds']:.2f} s "
          f"= {result['tokens_per_s']:,.1f} tok/s ({model_dir.name}, {config.device}, "
          f"tp {config.tensor_parallel_size}; start-up {result['startup_s']:.1f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def add_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Register ``offline`` under ``asyncinfer bench``."""
    from asyncinfer.options import add_engine_arguments

    parser = bench_subparsers.add_parser(
        "offline", help="tokens/s of LLM.generate over a fixed workload",
        description=DESCRIPTION)
    parser.add_argument("--workload", choices=sorted(OFFLINE_WORKLOADS), default="cpu",
                        help="cpu: 64 requests, greedy; gpu: nano-vllm's 256, temperature 0.6")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="run a model of this shape with dummy weights (no --model)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="default: the workload's (0 on cpu, 0.6 on gpu)")
    parser.add_argument("--json", default=None, help="also write the result to this file")
    add_engine_arguments(parser, title="engine options", defaults_here=DEFAULTS_HERE)
    parser.set_defaults(func=main)
    return parser
