"""The messages between the fronts and the engine core, and where their sockets live.

msgpack through msgspec: structs encoded as arrays, decoded into their types in one call.
In (front to core, one socket every front pushes to): :class:`Add`, :class:`Abort`,
:class:`AbortAll`, :class:`Shutdown`. Out (core to one front, a socket per front): one
:class:`Out` per engine round that produced something for that front's requests, carrying
every such request's new token and every request that ended, and the engine's counters.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import msgspec

from asyncinfer.core import ErrorKind, Event, FinishReason
from asyncinfer.outputs import EngineStats
from asyncinfer.params import SamplingParams


class Add(msgspec.Struct, array_like=True, tag=0):
    """A new request from front ``front``; ``params`` is a SamplingParams' fields in order."""

    front: int
    uid: int
    prompt_ids: list[int]
    params: tuple


class Abort(msgspec.Struct, array_like=True, tag=1):
    """Stop these requests (their reader went away or a stop string matched)."""

    uids: list[int]


class AbortAll(msgspec.Struct, array_like=True, tag=2):
    """Stop every request of front ``front`` (it drains, or stops)."""

    front: int


class Shutdown(msgspec.Struct, array_like=True, tag=3):
    """End every request and stop the core."""


Inbound = Add | Abort | AbortAll | Shutdown


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


class Out(msgspec.Struct, array_like=True):
    """What one round produced for one front's requests.

    ``tokens[i]`` is the new token of request ``uids[i]``; ``ends`` the requests that
    finished; ``stats`` the engine's counters after the round;
    ``received`` how many Adds of this front the core has taken so far (the front counts the
    rest as waiting)."""

    uids: list[int]
    tokens: list[int]
    ends: list[End]
    stats: EngineStats
    received: int


def params_fields(params: SamplingParams) -> tuple:
    """SamplingParams as the tuple an Add carries."""
    return attrs.astuple(params, recurse=False)


def params_from(fields: tuple | list) -> SamplingParams:
    """The SamplingParams an Add carried (validated again)."""
    return SamplingParams(*fields)


@attrs.frozen
class Addresses:
    """The core's sockets: every front pushes to ``inbound``; front ``i`` pulls
    ``outbound(i)``. Unix domain sockets in a directory the server owns."""

    directory: str

    @property
    def inbound(self) -> str:
        return f"ipc://{Path(self.directory) / 'in'}"

    def outbound(self, front: int) -> str:
        return f"ipc://{Path(self.directory) / f'out-{front}'}"


@attrs.frozen
class CoreInfo:
    """What the core tells the server once its model is loaded (the ready banner and the
    routes that describe the server show it): ``device`` is rank 0's, ``dtype`` torch's
    name of the engine's, ``attention`` the backend that runs it."""

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


encode = msgspec.msgpack.Encoder().encode
decode_inbound = msgspec.msgpack.Decoder(Inbound).decode
decode_out = msgspec.msgpack.Decoder(Out).decode
