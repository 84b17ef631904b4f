"""asyncinfer: an LLM inference engine with swappable scheduling policies."""

from asyncinfer.api import LLM, RequestOutput, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
