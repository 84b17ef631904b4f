"""Scheduling policies: the Policy protocol, the built-ins, and loading by registered name."""

from asyncinfer.policies.base import (
    Decision,
    Policy,
    RunningRequest,
    SchedulerView,
    TenantService,
    WaitingRequest,
)
from asyncinfer.policies.builtin import (
    DecodeFirst,
    PrefillFirst,
    Priority,
    SkipAhead,
    StallFree,
)
from asyncinfer.policies.registry import load_policy

__all__ = [
    "Decision",
    "DecodeFirst",
    "Policy",
    "PrefillFirst",
    "Priority",
    "RunningRequest",
    "SchedulerView",
    "SkipAhead",
    "StallFree",
    "TenantService",
    "WaitingRequest",
    "load_policy",
]
