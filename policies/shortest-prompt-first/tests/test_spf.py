"""shortest_prompt_first on hand-built views, and its discovery through asyncinfer's registry.

Needs the plugin installed: ``pip install -e policies/shortest-prompt-first --no-deps``.
"""

from __future__ import annotations

from typing import Any

import pytest
from asyncinfer_spf import ShortestPromptFirst
from hypothesis import given
from hypothesis import strategies as st

from asyncinfer.errors import ConfigError
from asyncinfer.policies import (
    Decision,
    Policy,
    RunningRequest,
    SchedulerView,
    WaitingRequest,
    load_policy,
)
from asyncinfer.policies.registry import available_policies, describe_policies


def waiting(uid: int, prefill: int, waited: int = 0) -> WaitingRequest:
    return WaitingRequest(uid=uid, prompt_len=prefill, prefill_remaining=prefill,
                          remaining_tokens=16, arrival_round=100 - waited, waited_rounds=waited,
                          chunked=False)


def view(*wait: WaitingRequest, running: int = 0) -> SchedulerView:
    run = tuple(RunningRequest(uid=1000 + i, seq_len=50, remaining_tokens=10)
                for i in range(running))
    return SchedulerView(waiting=wait, running=run, free_pages=64, free_slots=8,
                         token_budget=512, page_size=16, round=100, decode_streak=0)


def test_shortest_prompt_goes_first_and_misfits_are_skipped() -> None:
    v = view(waiting(1, 900), waiting(2, 10), waiting(3, 50), running=2)
    assert ShortestPromptFirst().decide(v) == Decision.prefill([2, 3, 1], "skip")


def test_equal_prompts_keep_arrival_order() -> None:
    v = view(waiting(9, 40), waiting(4, 40), waiting(6, 20))
    assert ShortestPromptFirst().decide(v) == Decision.prefill([6, 9, 4], "skip")


def test_a_starved_request_goes_first_and_nothing_skips_it() -> None:
    v = view(waiting(1, 900, waited=5), waiting(2, 10), waiting(3, 800, waited=3),
             waiting(4, 50))
    decision = ShortestPromptFirst(max_wait_rounds=3).decide(v)
    assert decision == Decision.prefill([1, 3, 2, 4], "stop")


def test_a_request_is_starved_only_once_it_has_waited_max_wait_rounds() -> None:
    v = view(waiting(1, 900, waited=2), waiting(2, 10))
    assert ShortestPromptFirst(max_wait_rounds=3).decide(v).on_misfit == "skip"


def test_decodes_when_nothing_waits() -> None:
    assert ShortestPromptFirst().decide(view(running=1)) == Decision.decode()


@pytest.mark.parametrize("rounds", [0, -3, 1.5, True, "9"])
def test_max_wait_rounds_must_be_a_positive_integer(rounds: Any) -> None:
    with pytest.raises(ConfigError, match="shortest_prompt_first: option max_wait_rounds"):
        ShortestPromptFirst(max_wait_rounds=rounds)


@given(st.lists(st.tuples(st.integers(1, 2000), st.integers(0, 50)), max_size=8),
       st.integers(1, 40))
def test_same_view_same_decision_with_each_waiting_request_offered_once(
        requests: list[tuple[int, int]], max_wait: int) -> None:
    def build() -> SchedulerView:
        return view(*(waiting(uid, p, w) for uid, (p, w) in enumerate(requests)), running=1)

    decision = ShortestPromptFirst(max_wait).decide(build())
    assert decision == ShortestPromptFirst(max_wait).decide(build())
    assert sorted(decision.candidates) == list(range(len(requests)))


def test_asyncinfer_finds_the_plugin_through_its_entry_point() -> None:
    assert available_policies()["shortest_prompt_first"].value == (
        "asyncinfer_spf:ShortestPromptFirst")
    policy = load_policy("shortest_prompt_first", {"max_wait_rounds": 3})
    assert isinstance(policy, Policy)
    assert policy == ShortestPromptFirst(max_wait_rounds=3)
    assert "shortest_prompt_first" in describe_policies()


def test_asyncinfer_reports_a_bad_option_of_the_plugin() -> None:
    with pytest.raises(ConfigError, match="'shortest_prompt_first' has no option 'patience'"):
        load_policy("shortest_prompt_first", {"patience": 3})
