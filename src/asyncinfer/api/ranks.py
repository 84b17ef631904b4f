"""Rank start-up: rank 0 of a tensor-parallel engine starts ranks 1..N-1 itself."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from asyncinfer.config import EngineConfig, ModelConfig
from asyncinfer.distributed.launch import Ranks, backend_for
from asyncinfer.distributed.parallel import TensorParallel
from asyncinfer.errors import ConfigError
from asyncinfer.policies.base import Policy

Follow = Callable[[int, dict[str, Any]], None]


def needs_ranks(config: EngineConfig) -> bool:
    """Whether this engine starts its other ranks: it has some, and no process group."""
    if config.tensor_parallel_size == 1:
        return False
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


def launch_ranks(config: EngineConfig, model_dir: Path, policy: Policy | None,
                 follow: Follow) -> Ranks:
    """Start ranks 1..N-1 running ``follow(rank, options)`` (this process becomes rank 0),
    once the split is known to fit the model. Each rank builds its own policy once: from
    its name and options, or from ``policy`` (an instance) pickled."""
    model = ModelConfig.from_pretrained(model_dir)
    TensorParallel(0, config.tensor_parallel_size).check(
        model.num_heads, model.num_kv_heads, model.intermediate_size)
    options = attrs.asdict(config, recurse=False)
    options["policy_options"] = dict(config.policy_options)
    if policy is not None:
        try:
            options["policy"] = pickle.dumps(policy)
        except Exception as exc:
            raise ConfigError(f"the policy {policy.name!r} must be picklable to run on "
                              f"{config.tensor_parallel_size} tensor-parallel ranks: {exc}"
                              ) from exc
        del options["policy_options"]
    return Ranks.launch(config.tensor_parallel_size, backend_for(config.device), follow,
                        (options,))


def rank_options(options: dict[str, Any]) -> dict[str, Any]:
    """A started rank's engine options, its pickled policy (if any) unpickled."""
    if isinstance(options.get("policy"), bytes):
        return {**options, "policy": pickle.loads(options["policy"])}
    return options
