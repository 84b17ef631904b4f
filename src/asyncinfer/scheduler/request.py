"""A request as the scheduler tracks it (what a round reports for it is ``core.Event``)."""

from __future__ import annotations

from typing import Any

from attrs import define, field

from asyncinfer.params import SamplingParams


@define(eq=False)
class Req:
    """One request: its tokens, where its KV lives, and how far it has got.

    Positions ``[0, cached_len)`` have KV computed or computing in a launched batch;
    ``device_len`` tokens are in its token pool row, counting a sampled token not yet seen
    by the host. ``output_ids`` are the tokens the host has received. ``pages`` covers the
    positions in order; the first ``shared_pages`` belong to the prefix cache.

    A waiting request's prefill computes its whole sequence, ``seq_len`` tokens: the prompt,
    and for a request sent back to the queue (``preemptions > 0``) the outputs it had
    produced, so that it continues where it stopped. A ``suspect`` was in a batch that
    failed: it runs alone until a batch of its own samples a token.
    """

    uid: int
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int                     # clamped to what fits the context and the pool
    arrival_round: int
    row: int = -1
    cached_len: int = 0
    prefix_len: int = 0                 # tokens found in the prefix cache at first admission
    output_ids: list[int] = field(factory=list)
    pages: list[int] = field(factory=list)
    shared_pages: int = 0
    prefix_node: Any = None
    device_len: int = 0
    finished: bool = False
    preemptions: int = 0                # times sent back to the waiting queue
    suspect: bool = False

    @property
    def prompt_len(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        """Tokens so far: prompt and output."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_len(self) -> int:
        """The longest this request's sequence can get."""
        return self.prompt_len + self.max_tokens

    @property
    def admitted(self) -> bool:
        """Holds a table row (and so pages)."""
        return self.row >= 0

    @property
    def prefilled(self) -> bool:
        """Its whole prompt has KV; it decodes from now on."""
        return self.cached_len >= self.prompt_len

    @property
    def remaining_tokens(self) -> int:
        """Output tokens it may still produce."""
        return self.max_tokens - len(self.output_ids)

    def token_ids(self) -> list[int]:
        """Prompt followed by output."""
        return self.prompt_ids + self.output_ids
