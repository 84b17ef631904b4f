"""Logprobs on the scheduler's side: which prompt positions a batch scores, and the
runner's ``TopLogprobs`` rows as each request's ``TokenLogprob``s. See
docs/architecture.md, "Logprobs"."""

from __future__ import annotations

from collections.abc import Sequence

from asyncinfer.core import Batch, TokenLogprob, TopLogprobs
from asyncinfer.scheduler.request import Req


def scored_counts(decoding: Sequence[Req], admitted: Sequence[tuple[Req, int]]
                  ) -> list[int] | None:
    """``Batch.scored``: per request, the positions from its start that score a prompt
    token (up to the prompt's last but one, whose logits sample); None when none scores."""
    if not any(r.scoring for r, _ in admitted):
        return None
    return [0] * len(decoding) + [
        max(0, min(end, r.prompt_len - 1) - r.cached_len) if r.scoring else 0
        for r, end in admitted]


def token_logprob(token: int, values: list[float], ids: list[int], k: int) -> TokenLogprob:
    """One row of a ``TopLogprobs`` as lists: ``token``'s logprob and the first ``k`` of its
    top."""
    return TokenLogprob(token, values[0], tuple(zip(ids[:k], values[1 : k + 1])))


def sampled_logprobs(batch: Batch, tokens: Sequence[int], logprobs: TopLogprobs | None
                     ) -> list[TokenLogprob | None]:
    """Per request of ``batch``: its sampled token's logprob if it asks for them, else None
    (``logprobs`` has a row per request that samples and asks, in batch order)."""
    if logprobs is None:
        return [None] * batch.size
    values, ids = logprobs.values.tolist(), logprobs.ids.tolist()
    out: list[TokenLogprob | None] = []
    at = 0
    for params, sampled, token in zip(batch.params, batch.sample, tokens):
        if sampled and params.logprobs is not None and at < len(values):
            out.append(token_logprob(token, values[at], ids[at], params.logprobs))
            at += 1
        else:
            out.append(None)
    return out


def gather_scores(reqs: Sequence[Req], batch: Batch, scores: TopLogprobs) -> None:
    """Add a batch's prompt logprobs to each scoring request's, in position order (a
    recompute after a preemption adds only what is new)."""
    assert batch.scored is not None
    values, ids = scores.values.tolist(), scores.ids.tolist()
    at = 0
    for req, row, start, count in zip(reqs, batch.rows, batch.starts, batch.scored):
        rows, at = range(at, at + count), at + count
        if not count or req.finished or req.row != row or not req.scoring:
            continue
        k = req.params.prompt_logprobs or 0
        for position, r in enumerate(rows, start + 1):
            if position == len(req.scored) + 1:
                req.scored.append(token_logprob(req.prompt_ids[position], values[r], ids[r], k))


def scores_out(req: Req) -> tuple[TokenLogprob | None, ...] | None:
    """A scoring request's prompt logprobs (the first token's None), handed out once."""
    if not req.scoring:
        return None
    assert len(req.scored) == req.prompt_len - 1, (req.uid, len(req.scored))
    req.scored_sent = True
    scored, req.scored = req.scored, []
    return (None, *scored)
