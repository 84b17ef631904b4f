"""The public surface: ``AsyncEngine`` (in-process, async), ``LLM`` (offline, synchronous),
``SamplingParams``, ``RequestOutput`` and ``StreamDelta``."""

from asyncinfer.api.async_engine import AsyncEngine
from asyncinfer.api.llm import LLM
from asyncinfer.outputs import EngineStats, RequestMetrics, RequestOutput, StreamDelta
from asyncinfer.params import SamplingParams

__all__ = ["LLM", "AsyncEngine", "EngineStats", "RequestMetrics", "RequestOutput",
           "SamplingParams", "StreamDelta"]
