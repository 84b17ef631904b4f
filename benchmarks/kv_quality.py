"""How far an FP8 KV cache moves a model's next-token logits from the model's own cache.

Each model runs teacher-forced over the same random token sequences twice, once with the KV
cache in the model's dtype (the reference) and once in FP8: a short prefill, then one
position per decode step (every step reads the whole cached prefix back from the pool).
At every position it compares the next-token logits: top-1 agreement, the largest and the
mean absolute logit error, and the largest error over the logits' range. It also reports
the largest |K| and |V| the reference cache held, against the FP8 format's range. The
sequences are random ids; the embedded model also runs over a text in its tokenizer, where
its predictions are as confident as in real use.

    python -m benchmarks.kv_quality --models tiny-llama tiny-qwen3 embedded \\
        --json docs/benchmarks/cpu-kv-fp8-quality.json
"""

from __future__ import annotations

import argparse
import itertools
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from asyncinfer.config import EngineConfig
from asyncinfer.core import Batch
from asyncinfer.engine.runner import ModelRunner
from asyncinfer.kvcache.pool import FP8_DTYPES
from asyncinfer.params import SamplingParams
from benchmarks.util import git_commit, machine, write_report

_NO_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


def _runner(model_dir: Path, kv_cache_dtype: str, dtype: str, width: int,
            rows: int) -> ModelRunner:
    config = EngineConfig(dtype=dtype, kv_cache_dtype=kv_cache_dtype,  # type: ignore[arg-type]
                          page_size=16, max_running_requests=rows, max_seq_len=width,
                          num_pages=rows * (width // 16 + 3), batch_invariant=False)
    return ModelRunner(config, model_dir)


def _place(runner: ModelRunner, sequences: Sequence[Sequence[int]]) -> None:
    """Each sequence in its own row of the page table, in whole pages, row after row."""
    width = runner.page_table.shape[1]
    stride = -(-width // runner.page_size) * runner.page_size
    for row, seq in enumerate(sequences):
        runner.token_pool[row, : len(seq)] = torch.tensor(list(seq))
        runner.page_table[row] = torch.arange(row * stride, row * stride + width)


def teacher_forced_logits(runner: ModelRunner, sequences: Sequence[Sequence[int]],
                          prefill: int) -> torch.Tensor:
    """[steps, rows, vocab] float32: the logits after each position from ``prefill`` on."""
    _place(runner, sequences)
    n, length = len(sequences), len(sequences[0])
    rows = list(range(n))

    def run(start: int, end: int) -> torch.Tensor:
        batch = Batch(rows=rows, starts=[start] * n, ends=[end] * n,
                      params=[_NO_SAMPLING] * n, steps=[0] * n, sample=[False] * n)
        return runner.forward(batch).logits.float()

    steps = [run(0, prefill)]
    for pos in range(prefill, length - 1):
        steps.append(run(pos, pos + 1))
    return torch.stack(steps)


def text_sequences(model_dir: Path, text: str, sequences: int, length: int) -> list[list[int]]:
    """``sequences`` consecutive runs of ``length`` tokens of ``text``, in the model's own
    tokenizer: inputs the model predicts with the confidence of real use."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]
    if len(ids) < sequences * length:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {sequences * length}")
    return [ids[i * length : (i + 1) * length] for i in range(sequences)]


def compare(model_dir: Path, kv_cache_dtype: str, *, dtype: str = "bfloat16",
            sequences: int = 4, length: int = 96, prefill: int = 16,
            seed: int = 0, inputs: list[list[int]] | None = None) -> dict[str, Any]:
    """``kv_cache_dtype`` against the model's own cache, at (length - prefill) positions of
    each of ``sequences`` random sequences (or of the given ``inputs``)."""
    if inputs is not None:
        sequences, length = len(inputs), len(inputs[0])
    probe = _runner(model_dir, "auto", dtype, length + 1, sequences)
    vocab = probe.model_config.vocab_size
    rng = random.Random(seed)
    seqs = inputs or [[rng.randrange(3, min(vocab, 10000)) for _ in range(length)]
                      for _ in range(sequences)]
    ref = teacher_forced_logits(probe, seqs, prefill)
    k_max = float(probe.pool.k.abs().max())
    v_max = float(probe.pool.v.abs().max())
    del probe
    got = teacher_forced_logits(_runner(model_dir, kv_cache_dtype, dtype, length + 1,
                                        sequences), seqs, prefill)
    err = (got - ref).abs()
    spread = (ref.amax(-1) - ref.amin(-1)).clamp_min(1e-6)
    stored = EngineConfig(kv_cache_dtype=kv_cache_dtype).kv_cache_torch_dtype  # type: ignore[arg-type]
    return {
        "model": str(model_dir.name), "dtype": dtype, "kv_cache_dtype": kv_cache_dtype,
        "inputs": "random ids" if inputs is None else "text",
        "positions": int(ref.shape[0] * ref.shape[1]),
        "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
        "max_abs_logit_error": float(err.max()),
        "mean_abs_logit_error": float(err.mean()),
        "max_error_over_logit_range": float((err.amax(-1) / spread).max()),
        "reference_logit_range_median": float(spread.median()),
        "reference_k_absmax": k_max, "reference_v_absmax": v_max,
        "format_max": FP8_DTYPES.get(stored) if stored is not None else None,
    }


def _tiny(kind: str, folder: Path) -> Path:
    """The test suite's tiny models: random weights widened so argmax margins look trained."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    if kind == "tiny-llama":
        config: Any = LlamaConfig(
            vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
            tie_word_embeddings=False, eos_token_id=1, bos_token_id=0)
    else:
        config = Qwen3Config(
            vocab_size=512, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=1,
            bos_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.2 if "embed" in name else 0.08)
    path = folder / kind
    model.save_pretrained(path)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny-llama", "tiny-qwen3", "embedded"],
                        help="tiny-llama, tiny-qwen3, embedded, or model directories")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["fp8_e4m3", "fp8_e5m2"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--length", type=int, default=96)
    parser.add_argument("--text", default=str(Path(__file__).parent.parent / "docs" /
                                              "architecture.md"),
                        help="the embedded model also runs over this text (default: "
                             "docs/architecture.md) besides random ids")
    parser.add_argument("--json", help="write the record here")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            if name == "embedded":
                from asyncinfer.models.source import embedded_model_dir

                path = embedded_model_dir()
            elif name.startswith("tiny-"):
                path = _tiny(name, Path(tmp))
            else:
                path = Path(name)
            texts: list[list[list[int]] | None] = [None]
            if name == "embedded":
                texts.append(text_sequences(path, Path(args.text).read_text(), args.sequences,
                                            args.length))
            for inputs, kv in itertools.product(texts, args.kv_cache_dtypes):
                start = time.perf_counter()
                row = compare(path, kv, dtype=args.dtype, sequences=args.sequences,
                              length=args.length, inputs=inputs)
                row["model"], row["seconds"] = name, round(time.perf_counter() - start, 1)
                if inputs is not None:
                    row["inputs"] = f"text of {Path(args.text).name}"
                results.append(row)
                print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    write_report(args.json, {
        "benchmark": "kv_cache_fp8_quality", "command": "python -m benchmarks.kv_quality "
        + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        "commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "machine": machine(),
        "results": results})


if __name__ == "__main__":
    main()
