"""Reference outputs from Hugging Face transformers on the same weights."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def load_hf(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The transformers model of a local directory, in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: Sequence[int], new_tokens: int) -> list[int]:
    """Greedy continuation of one unpadded prompt, EOS ignored, with transformers' KV cache."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt)], device=device)
    out = model(ids, use_cache=True)
    tokens: list[int] = []
    for _ in range(new_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]], device=device),
                    past_key_values=out.past_key_values, use_cache=True)
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
