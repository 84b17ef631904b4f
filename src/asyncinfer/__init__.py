"""asyncinfer: an LLM inference engine with swappable scheduling policies."""

from asyncinfer.api import LLM, AsyncEngine, RequestOutput, SamplingParams, StreamDelta

__all__ = ["LLM", "AsyncEngine", "RequestOutput", "SamplingParams", "StreamDelta"]
__version__ = "0.1.0"
