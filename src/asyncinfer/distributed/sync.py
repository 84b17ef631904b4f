"""What keeps the ranks' engines in step, round by round (docs/architecture.md, 'Rank sync')."""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from asyncinfer.errors import EngineError
from asyncinfer.processes import has_exited

logger = logging.getLogger(__name__)

IDLE_TIMEOUT = timedelta(days=365)  # the followers wait in a collective while rank 0 idles

_peer_watch = False  # set in a rank process that the launcher started


def watch_peers_in_this_process() -> None:
    """Have this process's RoundSync end it when a peer rank exits (a launched rank)."""
    global _peer_watch
    _peer_watch = True


class RankError(EngineError):
    """The tensor-parallel ranks cannot go on together: every rank's loop ends."""


class RankDivergedError(RankError):
    """Two ranks formed different batches (their all-reduces would mix requests)."""


class RankLostError(RankError):
    """A rank's process is gone: every rank stops, its requests "unavailable" (HTTP 503)."""


class RoundSync:
    """The per-round channel of ``size`` ranks; ``describe`` names a rank gone (on rank 0)."""

    def __init__(self, rank: int, size: int, group: Any = None, check_every: int = 1,
                 describe: Any = None) -> None:
        import torch.distributed as dist

        self.rank, self.size, self.check_every = rank, size, check_every
        self.group = group if group is not None else dist.new_group(backend="gloo",
                                                                    timeout=IDLE_TIMEOUT)
        self.describe = describe
        self.rounds = 0
        self.closing = False  # set once the ranks are told to stop: exits are expected
        where: list[Any] = [None] * size
        dist.all_gather_object(where, (socket.gethostname(), os.getpid()), group=self.group)
        host = socket.gethostname()  # pids of other hosts mean nothing here
        self.pids: dict[int, int] = {r: pid for r, (h, pid) in enumerate(where)
                                     if h == host and r != rank}
        if _peer_watch:
            threading.Thread(target=self._watch_peers, daemon=True,
                             name="asyncinfer-tp-peers").start()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, items: list[Any]) -> list[Any]:
        """Rank 0's ``items`` on every rank (the others' arguments are ignored)."""
        import torch.distributed as dist

        box: list[Any] = [items if self.leader else None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.group)
        except RuntimeError as exc:
            raise self.failure(exc) from exc
        return list(box[0])

    def check(self, fields: Callable[[], dict[str, Any]]) -> None:
        """Compare ``fields()`` across the ranks every ``check_every`` rounds (0: never)."""
        import torch.distributed as dist

        self.rounds += 1
        if self.check_every <= 0 or self.rounds % self.check_every:
            return
        batch = fields()
        digest = hashlib.blake2b(pickle.dumps(batch), digest_size=8).hexdigest()
        digests: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(digests, digest, group=self.group)
            if len(set(digests)) == 1:
                return
            batches: list[Any] = [None] * self.size
            dist.all_gather_object(batches, batch, group=self.group)
        except RuntimeError as exc:
            raise self.failure(exc) from exc
        first = next(r for r in range(self.size) if batches[r] != batches[0])
        field = next(k for k in batches[0] if batches[0][k] != batches[first].get(k))
        raise RankDivergedError(
            f"tensor-parallel ranks diverged in round {self.rounds}: rank {first}'s batch "
            f"differs from rank 0's in {field}: {batches[0][field]!r} on rank 0, "
            f"{batches[first].get(field)!r} on rank {first}")

    def lost(self, wait: float = 0.0) -> str | None:
        """The first other rank whose process has exited, in words, waiting up to ``wait`` s."""
        deadline = time.monotonic() + wait
        while True:
            for rank, pid in self.pids.items():
                if has_exited(pid):
                    described = self.describe(rank) if self.describe else None
                    return described or f"rank {rank} (pid {pid}) exited"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _watch_peers(self) -> None:
        """End the process once another rank's exits while the ranks are not stopping."""
        while not self.closing:
            gone = self.lost()
            if gone and not self.closing:
                logger.error("tensor-parallel %s; rank %d stops", gone, self.rank)
                os._exit(1)
            time.sleep(0.2)

    def failure(self, exc: BaseException) -> RankError:
        """What every rank stops with after ``exc`` broke a collective or a batch: a
        RankLostError naming the rank gone, else a RankError (no rank can retry alone)."""
        if isinstance(exc, RankError):
            return exc
        gone = self.lost(wait=1.0)
        if gone:
            return RankLostError(f"tensor-parallel {gone}; rank {self.rank} stops")
        return RankError(f"tensor-parallel rank {self.rank}'s batch failed: {exc}")
