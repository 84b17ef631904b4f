"""The GPU offline benchmark: nano-vllm's workload on one GPU, beside transformers' continuous
batching, with the memory-bandwidth floor and a profile of one decode step.

``python -m benchmarks.offline --workload gpu --shape qwen3-0.6b`` (dummy weights).
Sampling follows nano-vllm's bench: temperature 0.6, EOS ignored.
"""

from __future__ import annotations

import contextlib
import gc
import json
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from asyncinfer.bench.throughput import offline_workload, shape_dir
from asyncinfer.coordinator import Round


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n // 2, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 10 * 2 * src.nbytes / (start.elapsed_time(end) / 1000)


def bandwidth_floor(model_dir: Path, prompts: list[list[int]], max_tokens: list[int],
                    bytes_per_s: float, max_running: int,
                    kv_dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Seconds to read what decoding must read, once: the weights once per decode step (all
    requests running together while they fit) and each token's whole KV prefix, in the
    cache's dtype (``kv_dtype``)."""
    from asyncinfer.config import ModelConfig

    cfg = ModelConfig.from_pretrained(model_dir)
    weights = 2 * (cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
                   + cfg.num_layers * (cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads)
                                       * cfg.head_dim
                                       + cfg.num_heads * cfg.head_dim * cfg.hidden_size
                                       + 3 * cfg.hidden_size * cfg.intermediate_size))
    kv_token = cfg.kv_bytes_per_token(kv_dtype)
    kv_reads = sum(n * len(p) + n * (n - 1) // 2 for p, n in zip(prompts, max_tokens))
    steps = sum(sorted(max_tokens, reverse=True)[::max_running]) if max_running < len(
        prompts) else max(max_tokens)
    total = steps * weights + kv_reads * kv_token
    seconds = total / bytes_per_s
    return {"bytes": total, "seconds": round(seconds, 3), "decode_steps": steps,
            "weight_bytes": weights, "kv_bytes_per_token": kv_token,
            "tokens_per_s": round(sum(max_tokens) / seconds, 1),
            "bandwidth_gb_s": round(bytes_per_s / 1e9, 1)}


def run_transformers_cb(model_dir: Path, prompts: list[list[int]], max_tokens: list[int],
                        device: str, budget_s: float) -> dict[str, Any]:
    """transformers' continuous batching (``init_continuous_batching``), random weights of
    the same shape, temperature 0.6, EOS never stops a request early."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    gen = GenerationConfig(max_new_tokens=max(max_tokens), do_sample=True, temperature=0.6,
                           eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    start = time.perf_counter()
    try:
        ids = [manager.add_request(input_ids=p, request_id=f"r{i}", max_new_tokens=n)
               for i, (p, n) in enumerate(zip(prompts, max_tokens))]
        done: dict[str, int] = {}
        while len(done) < len(ids) and time.perf_counter() - start < budget_s:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = len(result.generated_tokens)
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30)
    tokens = sum(done.values())
    finished = len(done) == len(ids)
    return {"engine": "transformers continuous batching", "tokens": tokens,
            "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
            "requests_finished": len(done), "complete": finished,
            **({} if finished else {"note": f"stopped at the {budget_s:.0f} s budget"})}


def free_cuda() -> None:
    """Return what a finished engine held to the device."""
    gc.collect()
    torch.cuda.empty_cache()


def host_profile(llm: Any, prompts: list[list[int]], params: list[Any], path: Path) -> None:
    """The workload again under cProfile (the coordinator runs on this thread): the host's
    functions by own time and by cumulative time, written to ``path``."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    seconds = time.perf_counter() - start
    out = io.StringIO()
    out.write(f"host profile: {seconds:.2f} s under cProfile\n")
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumulative").print_stats(45)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(out.getvalue())
    log(f"host profile written to {path} ({seconds:.2f} s under cProfile)")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def warm_up_prompts(extend_tokens: int, length: int = 512) -> list[list[int]]:
    """Prompts filling one full prefill round, of ids no workload prompt starts with (so
    the timed run finds nothing of them in the prefix cache): the run then starts on an
    engine whose allocators have seen a full-size batch, as a serving engine has."""
    rng = random.Random(1234)
    return [[rng.randrange(10001, 20000) for _ in range(length)]
            for _ in range(max(1, extend_tokens // length))]


@contextlib.contextmanager
def gc_pauses() -> Iterator[list[tuple[float, float, int]]]:
    """Within the block, each garbage collection as (perf_counter at start, seconds,
    generation), in the list it yields."""
    pauses: list[tuple[float, float, int]] = []
    began = [0.0]

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append((began[0], time.perf_counter() - began[0], info["generation"]))

    gc.callbacks.append(record)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(record)


def coordinator_time(rounds: list[Round]) -> dict[str, float]:
    """Seconds the coordinator spent on the host and awaiting the device over ``rounds``."""
    return {"host_s": round(sum(r.host_s for r in rounds), 3),
            "wait_s": round(sum(r.wait_s for r in rounds), 3)}


def host_stalls(rounds: list[Round], pauses: list[tuple[float, float, int]], start: float,
                longest: int = 20) -> dict[str, Any]:
    """The coordinator rounds that took the host longest and the garbage collections, in ms
    from ``start``, to set beside the GPU's longest idle gaps."""
    slow = sorted(rounds, key=lambda r: -r.host_s)[:longest]
    return {"slowest_rounds": [[round(1000 * (r.start - start), 2), round(1000 * r.host_s, 3),
                                round(1000 * r.wait_s, 3), r.phase, r.size] for r in slow],
            "rounds": len(rounds),
            "gc_ms_by_generation": {g: round(1000 * sum(d for _, d, gen in pauses if gen == g),
                                             2) for g in (0, 1, 2)},
            "gc_over_1ms": [[round(1000 * (t - start), 2), round(1000 * d, 2), g]
                            for t, d, g in pauses if d > 1e-3]}


def run_once(model: str, options: dict[str, Any], prompts: list[list[int]],
             params: list[Any], extend_tokens: int, *, gpu_busy: bool,
             host_profile_path: Path | None, profile_steps: tuple[tuple[int, int], ...],
             max_running: int) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
    """One round: build the engine, warm it up with a full prefill round, time the workload;
    then, as asked, a cProfile'd rerun and a profile of one decode step at each (batch,
    context) of ``profile_steps``. The engine is closed and its memory given back."""
    from asyncinfer.api import LLM
    from asyncinfer.params import SamplingParams
    from benchmarks.kernel_profile import profile_decode_step

    start = time.perf_counter()
    llm = LLM(model, skip_tokenizer_init=True, **options)
    startup = time.perf_counter() - start
    llm.generate(warm_up_prompts(extend_tokens),
                 SamplingParams(max_tokens=8, temperature=0.6, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    rounds: list[Round] = []
    llm.engine.observe_rounds(rounds.append)  # started by the warm-up
    trace = None
    with contextlib.ExitStack() as stack:
        if gpu_busy:  # the GPU's kernel time over the run, against the run's wall time
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            pauses = stack.enter_context(gc_pauses())
            trace = stack.enter_context(torch_profile(activities=[ProfilerActivity.CUDA]))
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
    llm.engine.observe_rounds(None)
    busy = None
    if trace is not None:
        from benchmarks.kernel_profile import kernel_busy

        busy = kernel_busy(trace)
        busy["host"] = host_stalls(rounds, pauses, start)
        log(f"GPU kernels busy {busy['busy_s']:.2f} s of {seconds:.2f} s wall: {busy}")
    tokens = sum(len(o.token_ids) for o in outputs)
    run = {"engine": "asyncinfer", "tokens": tokens, "seconds": round(seconds, 3),
           "tokens_per_s": round(tokens / seconds, 1), "startup_s": round(startup, 1),
           "options": options, "policy": llm.policy.name,
           "coordinator": coordinator_time(rounds),
           "batches": llm.engine.stats().batches_decode, **({"gpu_busy": busy} if busy else {})}
    if host_profile_path is not None:
        host_profile(llm, prompts, params, host_profile_path)
    profile = None
    if profile_steps:
        # Overwrites rows and pages of the (idle) engine: it is closed right after.
        profile = [profile_decode_step(llm.runner, min(bs, max_running), context)
                   for bs, context in profile_steps]
        log(json.dumps(profile))
    llm.close()
    del llm, outputs
    free_cuda()
    return run, profile


def main(args: Any) -> int:
    """``python -m benchmarks.offline --workload gpu``."""
    import tempfile

    from asyncinfer.config import EngineConfig
    from asyncinfer.models.source import resolve_model
    from asyncinfer.options import engine_options
    from asyncinfer.params import SamplingParams
    from benchmarks.util import git_commit, write_report

    prompts, max_tokens = offline_workload("gpu")
    temperature = 0.6 if args.temperature is None else args.temperature
    # The workload's defaults, then the engine options given on the command line.
    options: dict[str, Any] = {"device": "cuda", "max_running_requests": 256,
                               "max_seq_len": 2048, "max_extend_tokens": 16384,
                               **engine_options(args)}
    model = options.pop("model", None)
    if args.shape:
        options["load_format"] = "dummy"
    model_dir = (shape_dir(args.shape, Path(tempfile.mkdtemp())) if args.shape
                 else resolve_model(model))
    config = EngineConfig(**options)  # the options in full, checked before any model loads
    device = torch.device(config.device)
    max_running = config.max_running_requests
    bandwidth = copy_bandwidth(device)
    floor = bandwidth_floor(model_dir, prompts, max_tokens, bandwidth, max_running,
                            config.kv_cache_torch_dtype or torch.bfloat16)
    log(f"bandwidth floor: {json.dumps(floor)}")
    params = [SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True)
              for n in max_tokens]
    # Each round builds the engine afresh, so no round finds the workload's prompts in the
    # prefix cache of the one before. The last round also profiles, after its timed run; a
    # traced run (--gpu-busy) is a round of its own, left out of the median since tracing
    # slows it.
    runs: list[dict[str, Any]] = []
    traced = profile = None
    for round_ in range(args.rounds + (1 if args.gpu_busy else 0)):
        last, tracing = round_ == args.rounds - 1, round_ == args.rounds
        run, round_profile = run_once(
            str(model_dir), options, prompts, params, config.max_extend_tokens,
            gpu_busy=tracing, host_profile_path=(
                Path(args.host_profile) if args.host_profile and last else None),
            profile_steps=((256, 850), (64, 850), (1, 850)) if args.profile and last else (),
            max_running=max_running)
        run["round"] = round_
        log(json.dumps(run))
        if tracing:
            traced = run
        else:
            runs.append(run)
            profile = round_profile or profile
    ours = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]  # the median round
    tokens, seconds = ours["tokens"], ours["seconds"]
    peer = None
    if "transformers" in args.peers:
        try:
            peer = run_transformers_cb(model_dir, prompts, max_tokens, config.device,
                                       args.peer_budget)
        except Exception as exc:  # report a peer that could not run, do not lose our numbers
            peer = {"engine": "transformers continuous batching", "error": repr(exc)}
        log(json.dumps(peer))
    report = {
        "benchmark": "offline-gpu (nano-vllm workload)",
        "command": "python -m benchmarks.offline " + " ".join(sys.argv[1:]),
        "model": f"{model_dir.name} "
        f"({'dummy weights' if args.shape else config.load_format})", "dtype": config.dtype,
        "kv_cache_dtype": config.kv_cache_dtype, "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "commit": git_commit(), "requests": len(prompts), "temperature": temperature,
        "tokens": tokens, "seconds": ours["seconds"], "tokens_per_s": ours["tokens_per_s"],
        "peer": peer["engine"] if peer else None,
        "peer_tokens_per_s": peer.get("tokens_per_s") if peer else None,
        "speedup_over_peer": (round(ours["tokens_per_s"] / peer["tokens_per_s"], 1)
                              if peer and peer.get("tokens_per_s") else None),
        "bandwidth_floor": floor,
        "fraction_of_floor": round(floor["seconds"] / seconds, 3),
        "rounds": args.rounds,
        "rounds_tokens_per_s": [r["tokens_per_s"] for r in runs],
        "results": runs + ([peer] if peer else []), "decode_step_profile": profile,
        **({"traced_run": traced} if traced else {})}
    if args.rounds > 1:
        print("asyncinfer rounds: " + ", ".join(f"{r['tokens_per_s']:,.0f}" for r in runs)
              + " tok/s; the median round below")
    print(f"asyncinfer: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tok/s; "
          f"bandwidth floor {floor['seconds']:.2f} s ({floor['tokens_per_s']:,.0f} tok/s at "
          f"{floor['bandwidth_gb_s']:.0f} GB/s): {floor['seconds'] / seconds:.0%} of it")
    if peer and peer.get("tokens_per_s"):
        print(f"{peer['engine']}: {peer['tokens']} tokens in {peer['seconds']:.1f} s = "
              f"{peer['tokens_per_s']:,.0f} tok/s; asyncinfer is "
              f"{ours['tokens_per_s'] / peer['tokens_per_s']:.1f}x")
    write_report(args.json, report)
    return 0
