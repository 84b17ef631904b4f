"""The nouns every layer shares: a batch, what a forward returns, and what a round reports
per request. A leaf: it imports no other asyncinfer module but ``params``, and torch only
for type hints, so policies, the CLI and the server's parsing load without torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from attrs import define, field, frozen

from asyncinfer.params import SamplingParams

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length", "abort", "error"]
# Why a request ended in "error": "invalid", it can never run (a prompt longer than the
# context, ...), the client's to fix; "engine", the engine failed it (a batch that failed
# with it alone, a shutdown), the server's; "unavailable", the engine went away (its process
# died): another server may take the request.
ErrorKind = Literal["invalid", "engine", "unavailable"]


@define
class Batch:
    """One forward: request ``i`` owns table row ``rows[i]`` and computes positions
    ``[starts[i], ends[i])``; positions before ``starts[i]`` already have KV in the cache.

    Its input ids are read from the token pool, so the scheduler never needs the token values
    of a batch still in flight. When ``sample[i]`` is true, the sampled token is written back to
    the pool at position ``ends[i]`` (a chunk in the middle of a prompt samples nothing).
    ``steps[i]`` counts the tokens request ``i`` sampled before (it seeds per-request sampling).
    """

    rows: list[int]
    starts: list[int]
    ends: list[int]
    params: Sequence[SamplingParams]
    steps: list[int]
    sample: list[bool] = field()

    @sample.default
    def _sample_all(self) -> list[bool]:
        return [True] * len(self.rows)

    def __attrs_post_init__(self) -> None:
        n = len(self.rows)
        assert n > 0, "empty batch"
        assert len(self.starts) == len(self.ends) == len(self.params) == len(self.steps) == n
        assert len(self.sample) == n
        assert all(0 <= s < e for s, e in zip(self.starts, self.ends)), "empty extent"
        assert len(set(self.rows)) == n, "a row appears twice in one batch"

    @property
    def size(self) -> int:
        """Number of requests in the batch."""
        return len(self.rows)

    @property
    def extend_lens(self) -> list[int]:
        """Tokens computed per request this round."""
        return [e - s for s, e in zip(self.starts, self.ends)]

    @property
    def num_tokens(self) -> int:
        """Tokens computed this round, all requests together."""
        return sum(self.extend_lens)

    @property
    def phase(self) -> Literal["prefill", "decode"]:
        """Decode when every request computes exactly one token."""
        return "decode" if all(n == 1 for n in self.extend_lens) else "prefill"


@frozen
class ForwardOutput:
    """Sampled token per request (CPU), and the logits they came from: float32, or the
    model's dtype on the compiled CUDA path (``ModelRunner.logits_dtype``); after a CUDA
    graph replay, a view of the graph's output that the next replay overwrites.
    ``device_s``: seconds the device spent on the batch, from the moment its stream reached
    it to its end (CUDA; 0 where the device is the host)."""

    next_tokens: torch.Tensor
    logits: torch.Tensor
    device_s: float = 0.0


@frozen
class Event:
    """What one round produced for one request: a token, a finish, or both (or an error)."""

    uid: int
    token: int | None
    finish_reason: FinishReason | None = None
    error: str | None = None
    prefix_len: int = 0
    error_kind: ErrorKind | None = None     # with finish_reason "error"

    @property
    def finished(self) -> bool:
        """The request is done; no more events will follow."""
        return self.finish_reason is not None
