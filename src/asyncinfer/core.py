"""The nouns every layer shares: a batch, a forward's output, a round's event per request.
Imports only ``params`` (torch for type hints): loads without torch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from attrs import define, field, frozen

from asyncinfer.params import SamplingParams

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length", "abort", "error"]
# "error" whose fault: the client's (invalid), the engine's, or the engine is gone.
ErrorKind = Literal["invalid", "engine", "unavailable"]


@define
class Batch:
    """One forward: request ``i`` owns row ``rows[i]`` and computes positions
    ``[starts[i], ends[i])``, reading its input ids from the token pool.

    Invariants: KV exists before ``starts[i]``; with ``sample[i]`` the sampled token is
    written at ``ends[i]``; ``steps[i]`` counts the tokens sampled before (per-request seeds).
    ``scored[i]``: how many positions from ``starts[i]`` on score the prompt token after
    them (prompt logprobs); None when no request asks."""

    rows: list[int]
    starts: list[int]
    ends: list[int]
    params: Sequence[SamplingParams]
    steps: list[int]
    sample: list[bool] = field()
    scored: list[int] | None = None

    @sample.default
    def _sample_all(self) -> list[bool]:
        return [True] * len(self.rows)

    def __attrs_post_init__(self) -> None:
        n = len(self.rows)
        assert n > 0, "empty batch"
        assert len(self.starts) == len(self.ends) == len(self.params) == len(self.steps) == n
        assert len(self.sample) == n
        assert self.scored is None or (len(self.scored) == n and all(
            0 <= c <= e - s for c, s, e in zip(self.scored, self.starts, self.ends)))
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
class TopLogprobs:
    """Log-probabilities of some rows, on the host: ``values[r, 0]`` is row r's target
    token's, ``values[r, 1:]`` those of its ``ids[r]``, the k most probable tokens there
    (k: the most any of these rows asked for), most probable first."""

    values: torch.Tensor    # [R, 1 + k] float32
    ids: torch.Tensor       # [R, k] int64


@frozen
class ForwardOutput:
    """Sampled token per request (CPU) and their logits (after a graph replay, a view the
    next replay overwrites); ``device_s``: the batch's device seconds (CUDA, else 0).
    ``logprobs``: the sampled tokens' of the requests asking for them, in batch order (None
    when none does); ``prompt_logprobs``: the prompt positions ``Batch.scored`` names, in
    batch order (None when none)."""

    next_tokens: torch.Tensor
    logits: torch.Tensor
    device_s: float = 0.0
    logprobs: TopLogprobs | None = None
    prompt_logprobs: TopLogprobs | None = None


@frozen
class TokenLogprob:
    """One position's token with its log-probability under the model's raw distribution
    (log-softmax of the logits, before penalties, bias, temperature and filters), and the
    ``top`` most probable tokens there, most probable first, as (token id, logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@frozen
class Event:
    """What one round produced for one request: a token, a finish, or both (or an error)."""

    uid: int
    token: int | None
    finish_reason: FinishReason | None = None
    error: str | None = None
    prefix_len: int = 0
    error_kind: ErrorKind | None = None     # with finish_reason "error"
    logprob: TokenLogprob | None = None     # the token's, when the request asks for them
    # Every prompt token's (the first None), with the request's first token or its finish.
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    @property
    def finished(self) -> bool:
        """The request is done; no more events will follow."""
        return self.finish_reason is not None
