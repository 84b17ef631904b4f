"""What keeps the ranks' engines in step: each round, rank 0 shares what arrived (new
requests, aborts, a stop) and every rank applies the same list; then every rank forms its
batch itself, and a digest of it is compared across the ranks.

Both travel on a gloo group of their own, apart from the model's collectives (which the
device's forward runs, possibly in another thread at the same time).
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

from asyncinfer.errors import EngineError


class RankDivergedError(EngineError):
    """Two ranks formed different batches: their all-reduces would add up different
    requests. Every rank stops."""


class RoundSync:
    """The per-round channel of ``size`` ranks; this process is ``rank``."""

    def __init__(self, rank: int, size: int, group: Any = None, check_every: int = 1) -> None:
        import torch.distributed as dist

        self.rank, self.size, self.check_every = rank, size, check_every
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self.rounds = 0

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, items: list[Any]) -> list[Any]:
        """Rank 0's ``items`` on every rank (the others' arguments are ignored)."""
        import torch.distributed as dist

        box: list[Any] = [items if self.leader else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return list(box[0])

    def check(self, batch: dict[str, Any]) -> None:
        """Compare this round's batch (its fields by name, picklable) across the ranks,
        every ``check_every`` rounds; raise RankDivergedError naming the round and the
        first field that differs."""
        import torch.distributed as dist

        self.rounds += 1
        if self.check_every <= 0 or self.rounds % self.check_every:
            return
        digest = hashlib.blake2b(pickle.dumps(batch), digest_size=8).hexdigest()
        digests: list[Any] = [None] * self.size
        dist.all_gather_object(digests, digest, group=self.group)
        if len(set(digests)) == 1:
            return
        batches: list[Any] = [None] * self.size
        dist.all_gather_object(batches, batch, group=self.group)
        first = next(r for r in range(self.size) if batches[r] != batches[0])
        field = next(k for k in batches[0] if batches[0][k] != batches[first].get(k))
        raise RankDivergedError(
            f"tensor-parallel ranks diverged in round {self.rounds}: rank {first}'s batch "
            f"differs from rank 0's in {field}: {batches[0][field]!r} on rank 0, "
            f"{batches[first].get(field)!r} on rank {first}")
