"""Mistral: Llama's layers (no biases) with a sliding window on every layer."""

from __future__ import annotations

from typing import ClassVar

from asyncinfer.models.blocks import DecoderModel


class MistralForCausalLM(DecoderModel):
    """Mistral: each query attends the last ``sliding_window`` positions (``null``: all)."""

    implements_sliding_window: ClassVar[bool] = True
