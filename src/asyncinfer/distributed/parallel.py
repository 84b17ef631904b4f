"""A rank's part of a Megatron-split model (docs/architecture.md, 'Tensor-parallel split')."""

from __future__ import annotations

from typing import Any

import torch
from attrs import frozen

from asyncinfer.errors import ConfigError


@frozen
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None

    @classmethod
    def join(cls, size: int) -> TensorParallel:
        """This process's rank in torch.distributed's default group of ``size`` processes."""
        if size == 1:
            return cls()
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(f"tensor_parallel_size={size} needs torch.distributed's default "
                              "process group, initialized in every rank's process")
        if dist.get_world_size() != size:
            raise ConfigError(f"tensor_parallel_size={size} but the process group holds "
                              f"{dist.get_world_size()} processes")
        return cls(dist.get_rank(), size, dist.group.WORLD)

    def check(self, heads: int, kv_heads: int, intermediate: int) -> None:
        """Refuse a split that does not divide the model's head counts and MLP."""
        for what, n in (("attention heads", heads), ("KV heads", kv_heads),
                        ("MLP width", intermediate)):
            if n % self.size:
                raise ConfigError(f"tensor_parallel_size={self.size} does not divide the "
                                  f"model's {what} ({n})")

    def part(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's equal part of ``tensor`` along ``dim``."""
        if self.size == 1:
            return tensor
        per = tensor.shape[dim] // self.size
        return tensor.narrow(dim, self.rank * per, per)

    def vocab_rows(self, vocab: int) -> tuple[int, int]:
        """First row and row count of this rank's ``ceil(vocab / size)`` vocabulary rows."""
        per = -(-vocab // self.size)
        start = min(self.rank * per, vocab)
        return start, min(per, vocab - start)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (in place)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab: int) -> torch.Tensor:
        """Every rank's logits over its vocabulary rows [T, local], side by side: [T, vocab]."""
        if self.size == 1:
            return logits
        import torch.distributed as dist

        per = -(-vocab // self.size)
        if logits.shape[-1] < per:  # the last rank's short slice, padded for the gather
            logits = torch.nn.functional.pad(logits, (0, per - logits.shape[-1]))
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., :vocab]
