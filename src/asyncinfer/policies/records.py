"""The records of one waiting and one running request, as a policy reads them."""

from __future__ import annotations

from attrs import frozen


@frozen
class WaitingRequest:
    """A request waiting for (the rest of) its prefill."""

    uid: int
    prompt_len: int             # tokens to prefill: the prompt (and a preempted one's outputs)
    prefill_remaining: int      # of those, still to compute (before prefix matching)
    remaining_tokens: int       # output tokens it may still produce
    arrival_round: int          # the scheduler round in which it arrived
    waited_rounds: int          # rounds since arrival
    chunked: bool               # part of its prompt is computed already (chunked prefill)
    priority: int = 0           # the request's priority (lower first; SamplingParams)
    preemptions: int = 0        # times it was sent back from the running set
    tenant: str = ""            # whom it is for (SamplingParams.tenant)
    prefix_match: int = 0       # tokens found in the prefix cache when last looked up (a hint)


@frozen
class RunningRequest:
    """A request that has finished its prefill and is decoding."""

    uid: int
    seq_len: int                # tokens so far, prompt and output
    remaining_tokens: int       # output tokens it may still produce
    priority: int = 0           # the request's priority (lower first; SamplingParams)
    arrival_round: int = 0      # the scheduler round in which it arrived
    tenant: str = ""            # whom it is for (SamplingParams.tenant)
