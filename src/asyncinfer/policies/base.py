"""The Policy protocol: a policy reads a SchedulerView and returns a Decision.

Contract: deterministic in the sequence of views (``served`` covers only the time since the
previous view, so a fair-share policy keeps state); no clocks, randomness, ids or hash order.
A view costs O(1) to make; a policy pays for the records it reads, so one that stays O(1)
reads a window of the queue front or an ``ordered`` index. See docs/architecture.md,
'Scheduler view cost'.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

from attrs import field, frozen

from asyncinfer.policies.records import RunningRequest, WaitingRequest
from asyncinfer.policies.view import RunningView, WaitingView, as_running, as_waiting


def _optional_tuple(value: Any) -> tuple[int, ...] | None:
    return None if value is None else tuple(value)


__all__ = ["Decision", "Policy", "RunningRequest", "RunningView", "SchedulerView",
           "TenantService", "WaitingRequest", "WaitingView"]


@frozen
class TenantService:
    """Tokens served to one tenant since the previous view: a prompt once, at its first
    admission; an output token when processed. Summed over views, all it was served."""

    tenant: str
    input_tokens: int
    output_tokens: int


@frozen
class SchedulerView:
    """What a policy may read, never the scheduler itself; the queues are read lazily, so a
    view is valid only while the ``decide`` it was passed to runs."""

    waiting: WaitingView = field(converter=as_waiting)   # queue order; a tuple is wrapped
    running: RunningView = field(converter=as_running)   # uid order
    free_pages: int                        # pages a new request may still claim
    free_slots: int                        # request slots (table rows) free
    token_budget: int                      # prefill tokens one round may compute
    page_size: int
    round: int                             # logical clock: batches run so far
    decode_streak: int                     # decode rounds in a row just before this one
    served: tuple[TenantService, ...] = ()  # since the previous view, by tenant name


@frozen
class Decision:
    """Decode the running set, or prefill from ``candidates`` (uids, in order), stopping at
    or skipping a misfit (``on_misfit``); a prefill that admits nothing decodes instead.
    ``preempt``: running requests to re-queue first; they resume with the same tokens.

    "mixed": one batch of both, the running requests in ``decoding`` (None: all) decoding
    and the candidates prefilling in what is left of the round's budget (``token_budget``,
    at most the engine's; each decoding request counts one token). See
    docs/architecture.md, 'Mixed batches'."""

    action: Literal["prefill", "decode", "mixed"]
    candidates: tuple[int, ...] = field(default=(), converter=tuple)
    on_misfit: Literal["stop", "skip"] = "stop"
    preempt: tuple[int, ...] = field(default=(), converter=tuple)
    decoding: tuple[int, ...] | None = field(default=None, converter=_optional_tuple)
    token_budget: int | None = None

    @classmethod
    def decode(cls) -> Decision:
        """Run one decode round over every running request."""
        return cls("decode")

    @classmethod
    def prefill(cls, candidates: Any, on_misfit: Literal["stop", "skip"] = "stop",
                preempt: Any = ()) -> Decision:
        """Admit from ``candidates`` in order (after preempting ``preempt``)."""
        return cls("prefill", tuple(candidates), on_misfit, tuple(preempt))

    @classmethod
    def mixed(cls, candidates: Any = (), on_misfit: Literal["stop", "skip"] = "stop",
              decode: Any = None, preempt: Any = (), token_budget: int | None = None
              ) -> Decision:
        """Decode ``decode`` (running uids; None: every running request) and admit from
        ``candidates`` in order into the rest of ``token_budget`` (None: the engine's)."""
        return cls("mixed", tuple(candidates), on_misfit, tuple(preempt),
                   None if decode is None else tuple(decode), token_budget)


@runtime_checkable
class Policy(Protocol):
    """Chooses the next batch; the same views in the same order give the same decisions."""

    name: str

    def decide(self, view: SchedulerView) -> Decision:
        """The decision for one round; called only when something is waiting or running."""
        ...
