"""The messages between the fronts and the engine core (msgpack through msgspec), and
where their sockets live. In: Add, Abort, AbortAll, Shutdown, Hello, FlushCache, on one
socket every front pushes to. Out: one :class:`Out` per round per front with news (and the
answers to FlushCache), on a socket per front."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import msgspec

from asyncinfer.core import ErrorKind, Event, FinishReason, TokenLogprob
from asyncinfer.outputs import EngineStats
from asyncinfer.params import SamplingParams


class Add(msgspec.Struct, array_like=True, tag=0):
    """A new request from front ``front``; ``params`` are its SamplingParams by field name."""

    front: int
    uid: int
    prompt_ids: list[int]
    params: dict[str, Any]


class Abort(msgspec.Struct, array_like=True, tag=1):
    """Stop these requests (their reader went away or a stop string matched)."""

    uids: list[int]


class AbortAll(msgspec.Struct, array_like=True, tag=2):
    """Stop every request of front ``front`` (it drains, or stops)."""

    front: int


class Shutdown(msgspec.Struct, array_like=True, tag=3):
    """End every request and stop the core."""


class Hello(msgspec.Struct, array_like=True, tag=4):
    """Front ``front`` asks for an Out: its answer shows the core's socket to it is joined
    (the core drops what it sends a front not yet connected)."""

    front: int


class FlushCache(msgspec.Struct, array_like=True, tag=5):
    """Front ``front`` asks the core to empty its prefix cache; the answer, a
    :class:`Flushed` with the same ``ticket``, comes in an Out."""

    front: int
    ticket: int


Inbound = Add | Abort | AbortAll | Shutdown | Hello | FlushCache


class Flushed(msgspec.Struct, array_like=True):
    """The answer to FlushCache ``ticket``: pages freed and pages left (running requests
    hold them), or why it could not be done."""

    ticket: int
    freed_pages: int = 0
    held_pages: int = 0
    error: str | None = None


class End(msgspec.Struct, array_like=True):
    """A request that finished this round (after its token in ``Out.tokens``, if any)."""

    uid: int
    reason: str
    error: str | None = None
    error_kind: str | None = None
    prefix_len: int = 0

    def event(self) -> Event:
        reason: FinishReason = self.reason  # type: ignore[assignment]
        kind: ErrorKind | None = self.error_kind  # type: ignore[assignment]
        return Event(self.uid, None, reason, self.error, self.prefix_len, kind)


class Logprob(msgspec.Struct, array_like=True):
    """A ``core.TokenLogprob`` on the wire."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = []

    @classmethod
    def of(cls, logprob: TokenLogprob) -> Logprob:
        return cls(logprob.token, logprob.logprob, list(logprob.top))

    def core(self) -> TokenLogprob:
        return TokenLogprob(self.token, self.logprob, tuple(self.top))


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Request ``uid``'s prompt logprobs (the first None), before its first token or end."""

    uid: int
    entries: list[Logprob | None]


class Out(msgspec.Struct, array_like=True):
    """One round's news for one front: ``tokens[i]`` is request ``uids[i]``'s new token;
    ``received`` counts the Adds of this front the core has taken (the rest are waiting).
    ``logprobs``: (i, the logprob of ``tokens[i]``) for the requests that ask for them;
    ``prompts``: prompt logprobs, each before its request's tokens and end here."""

    uids: list[int]
    tokens: list[int]
    ends: list[End]
    stats: EngineStats
    received: int
    logprobs: list[tuple[int, Logprob]] = []
    prompts: list[PromptLogprobs] = []
    flushed: list[Flushed] = []


def params_fields(params: SamplingParams) -> dict[str, Any]:
    """SamplingParams as an Add carries them: every field, by name."""
    return attrs.asdict(params, recurse=False)


def params_from(fields: dict[str, Any]) -> SamplingParams:
    """The SamplingParams an Add carried, validated again (an unknown field: TypeError)."""
    return SamplingParams(**fields)


@attrs.frozen
class Addresses:
    """The core's Unix sockets: fronts push to ``inbound``; front ``i`` pulls ``outbound(i)``."""

    directory: str

    @property
    def inbound(self) -> str:
        return f"ipc://{Path(self.directory) / 'in'}"

    def outbound(self, front: int) -> str:
        return f"ipc://{Path(self.directory) / f'out-{front}'}"


@attrs.frozen
class Step:
    """What the core is doing while it starts (fetching, converting, loading the model)."""

    text: str


@attrs.frozen
class CoreInfo:
    """What the core tells the server once its model is loaded (``device``: rank 0's)."""

    pid: int
    model_name: str
    model_dir: str
    context_len: int
    kv_pages_total: int
    page_size: int = 16
    policy: str = ""
    tp_size: int = 1
    device: str = ""
    dtype: str = ""
    attention: str = ""
    cpu_threads: int = 0        # the threads rank 0 computes with on a CPU (0: not a CPU)


encode = msgspec.msgpack.Encoder().encode
decode_inbound = msgspec.msgpack.Decoder(Inbound).decode
decode_out = msgspec.msgpack.Decoder(Out).decode
