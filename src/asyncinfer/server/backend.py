"""What the server needs of an engine: :class:`GenerateBackend`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from asyncinfer.outputs import CacheFlush, RequestOutput, StreamDelta
    from asyncinfer.params import SamplingParams
    from asyncinfer.tokenizer import Tokenizer


class GenerateBackend(Protocol):
    """Where the server sends its requests: ``AsyncEngine`` in process, ``EngineClient``
    to an engine core process."""

    @property
    def model_name(self) -> str: ...
    @property
    def tokenizer(self) -> Tokenizer | None: ...
    @property
    def context_len(self) -> int: ...
    async def generate(self, prompt: str | list[int],
                       params: SamplingParams | None = None) -> RequestOutput: ...
    def stream(self, prompt: str | list[int],
               params: SamplingParams | None = None) -> AsyncIterator[StreamDelta]: ...
    def stats(self) -> Any: ...
    async def flush_cache(self) -> CacheFlush: ...
    @property
    def alive(self) -> bool: ...
    def abort_all(self) -> None: ...
