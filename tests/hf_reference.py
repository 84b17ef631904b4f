"""Reference outputs from Hugging Face transformers on the same weights."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path

import torch


def load_hf(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The transformers model of a local directory, in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def _cache_keyword(model: torch.nn.Module) -> str:
    """The keyword by which the model's forward takes a KV cache.

    transformers renamed it within 5.x, from ``past_key_values`` (as in 5.0) to ``cache`` (as
    in 5.24), and deprecated the old name, and the ``past_key_values`` attribute of outputs,
    for removal in 5.40. The new name is used wherever the forward has it; ``past_key_values``
    only where it is still the current one, so no version that ``pyproject.toml`` allows is
    asked for a deprecated name.
    """
    return "cache" if "cache" in inspect.signature(model.forward).parameters else (
        "past_key_values")


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: Sequence[int], new_tokens: int) -> list[int]:
    """Greedy continuation of one unpadded prompt, EOS ignored: the argmax of the last
    position's logits, every token fed back through transformers' own KV cache.

    The cache is a ``DynamicCache`` made here and filled in place by each forward (the way
    transformers' documentation passes one), so nothing is read back from the output but the
    logits. A rerun of the whole sequence without a cache gives the same tokens on the test
    models but costs several times as long on the embedded one.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = {_cache_keyword(model): DynamicCache(config=model.config)}
    logits = model(torch.tensor([list(prompt)], device=device), use_cache=True, **cache).logits
    tokens: list[int] = []
    for _ in range(new_tokens):
        token = int(logits[0, -1].argmax())
        tokens.append(token)
        logits = model(torch.tensor([[token]], device=device), use_cache=True, **cache).logits
    return tokens


@torch.inference_mode()
def hf_last_logits(model: torch.nn.Module, sequence: Sequence[int]) -> torch.Tensor:
    """Float32 logits of the last position of one sequence."""
    return model(torch.tensor([list(sequence)])).logits[0, -1].float()


def place_rows(runner: object, sequences: Sequence[Sequence[int]]) -> None:
    """Put each sequence in its own table row, its KV slots in whole pages, row after row."""
    page_table, token_pool = runner.page_table, runner.token_pool  # type: ignore[attr-defined]
    page_size = runner.page_size  # type: ignore[attr-defined]
    width = page_table.shape[1]
    stride = -(-width // page_size) * page_size
    for row, seq in enumerate(sequences):
        token_pool[row, : len(seq)] = torch.tensor(list(seq))
        page_table[row] = torch.arange(row * stride, row * stride + width)
