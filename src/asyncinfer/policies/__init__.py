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
    LongestPrefixMatch,
    PrefillFirst,
    Priority,
    SkipAhead,
    StallFree,
)
from asyncinfer.policies.registry import load_policy
from asyncinfer.policies.view import SKIP_WINDOW, RunningView, WaitingView, candidates, fresh

__all__ = [
    "SKIP_WINDOW",
    "Decision",
    "DecodeFirst",
    "LongestPrefixMatch",
    "Policy",
    "PrefillFirst",
    "Priority",
    "RunningRequest",
    "RunningView",
    "SchedulerView",
    "SkipAhead",
    "StallFree",
    "TenantService",
    "WaitingRequest",
    "WaitingView",
    "candidates",
    "fresh",
    "load_policy",
]
