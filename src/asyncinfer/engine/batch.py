"""What the runner needs to know about one round: which rows compute which positions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from attrs import define, field

from asyncinfer.params import SamplingParams


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
