"""The built-in policies' decisions on hand-built views, and the policy registry."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from typing import Any, Literal

import attrs
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from asyncinfer.errors import ConfigError
from asyncinfer.policies import (
    Decision,
    DecodeFirst,
    LongestPrefixMatch,
    Policy,
    PrefillFirst,
    Priority,
    RunningRequest,
    SchedulerView,
    SkipAhead,
    StallFree,
    WaitingRequest,
    load_policy,
    registry,
)
from asyncinfer.policies.registry import (
    GROUP,
    available_policies,
    describe_policies,
    parse_policy_options,
)

BUILTINS = {"prefill_first": PrefillFirst, "decode_first": DecodeFirst, "skip_ahead": SkipAhead,
            "priority": Priority, "stall_free": StallFree, "lpm": LongestPrefixMatch}


def waiting(uid: int, prefill: int = 100, waited: int = 0, chunked: bool = False,
            remaining_tokens: int = 16, match: int = 0) -> WaitingRequest:
    """A waiting request; ``prefill`` tokens left, arrived ``waited`` rounds before round 100."""
    return WaitingRequest(uid=uid, prompt_len=prefill, prefill_remaining=prefill,
                          remaining_tokens=remaining_tokens, arrival_round=100 - waited,
                          waited_rounds=waited, chunked=chunked, prefix_match=match)


def running(uid: int) -> RunningRequest:
    return RunningRequest(uid=uid, seq_len=50, remaining_tokens=10)


def view(wait: tuple[WaitingRequest, ...] = (), run: tuple[RunningRequest, ...] = (),
         decode_streak: int = 0) -> SchedulerView:
    return SchedulerView(waiting=wait, running=run, free_pages=64, free_slots=8,
                         token_budget=512, page_size=16, round=100,
                         decode_streak=decode_streak)


def prefill(*uids: int, on_misfit: Literal["stop", "skip"] = "stop") -> Decision:
    return Decision.prefill(uids, on_misfit)


# ---- prefill_first -------------------------------------------------------------------------

def test_prefill_first_offers_every_waiting_request_in_arrival_order_and_stops() -> None:
    v = view((waiting(7, 900, waited=5), waiting(3, 10, waited=2), waiting(5, 50)), (running(1),))
    assert PrefillFirst().decide(v) == prefill(7, 3, 5)


def test_prefill_first_decodes_when_nothing_waits() -> None:
    assert PrefillFirst().decide(view((), (running(1),))) == Decision.decode()


# ---- decode_first --------------------------------------------------------------------------

def test_decode_first_decodes_while_requests_run_below_the_cap() -> None:
    v = view((waiting(2),), (running(1),), decode_streak=3)
    assert DecodeFirst(max_decode_rounds=4).decide(v) == Decision.decode()


def test_decode_first_prefills_in_arrival_order_when_nothing_runs() -> None:
    v = view((waiting(4, 10), waiting(2, 5)))
    assert DecodeFirst().decide(v) == prefill(4, 2)


@pytest.mark.parametrize("cap", [1, 4, 9])
def test_decode_first_prefills_once_the_decode_streak_reaches_the_cap(cap: int) -> None:
    v = view((waiting(4, 10), waiting(2, 5)), (running(1),), decode_streak=cap)
    assert DecodeFirst(max_decode_rounds=cap).decide(v) == prefill(4, 2)


def test_decode_first_decodes_at_the_cap_when_nothing_waits() -> None:
    v = view((), (running(1),), decode_streak=100)
    assert DecodeFirst(max_decode_rounds=2).decide(v) == Decision.decode()


@pytest.mark.parametrize("cap", [1, 3])
def test_decode_first_never_runs_more_than_cap_decode_rounds_in_a_row_while_work_waits(
        cap: int) -> None:
    policy, streak, longest = DecodeFirst(max_decode_rounds=cap), 0, 0
    for _ in range(50):  # a request always waits and fits; decode streaks reset on prefill
        decision = policy.decide(view((waiting(9),), (running(1),), decode_streak=streak))
        streak = streak + 1 if decision.action == "decode" else 0
        longest = max(longest, streak)
    assert longest == cap


@pytest.mark.parametrize("cap", [0, -1, 2.0, True, "4"])
def test_decode_first_rejects_a_cap_that_is_not_a_positive_integer(cap: Any) -> None:
    with pytest.raises(ConfigError, match="decode_first: option max_decode_rounds"):
        DecodeFirst(max_decode_rounds=cap)


# ---- skip_ahead ----------------------------------------------------------------------------

def test_skip_ahead_offers_smaller_requests_first_and_skips_misfits() -> None:
    v = view((waiting(1, 900), waiting(2, 10), waiting(3, 50)), (running(9),))
    assert SkipAhead().decide(v) == prefill(2, 3, 1, on_misfit="skip")


def test_skip_ahead_aging_lets_an_older_request_pass_a_smaller_one() -> None:
    # priorities: uid 1: 2*40 - 100 = -20, uid 2: 2*0 - 30 = -30
    v = view((waiting(1, 100, waited=40), waiting(2, 30)))
    assert SkipAhead(aging=2.0, threshold=1000.0).decide(v) == prefill(1, 2, on_misfit="skip")


def test_skip_ahead_breaks_priority_ties_by_arrival_order() -> None:
    # priorities: uid 8: 10 - 20 = -10, uid 3: 0 - 10 = -10, uid 5: 0 - 5 = -5
    v = view((waiting(8, 20, waited=10), waiting(3, 10), waiting(5, 5)))
    assert SkipAhead().decide(v) == prefill(5, 8, 3, on_misfit="skip")


def test_skip_ahead_puts_old_requests_first_in_arrival_order_and_stops() -> None:
    v = view((waiting(1, 900, waited=70), waiting(2, 10, waited=3),
              waiting(3, 800, waited=64), waiting(4, 5)))
    assert SkipAhead(threshold=64.0).decide(v) == prefill(1, 3, 4, 2)


def test_skip_ahead_calls_a_request_old_after_ceil_threshold_over_aging_rounds() -> None:
    policy = SkipAhead(aging=0.5, threshold=3.0)
    assert policy.old_after == 6
    young = view((waiting(1, 900, waited=5), waiting(2, 10)))
    old = view((waiting(1, 900, waited=6), waiting(2, 10)))
    assert policy.decide(young) == prefill(2, 1, on_misfit="skip")
    assert policy.decide(old) == prefill(1, 2)


def test_skip_ahead_with_threshold_zero_is_first_come_first_served() -> None:
    v = view((waiting(1, 900), waiting(2, 10), waiting(3, 50)))
    assert SkipAhead(threshold=0.0).decide(v) == PrefillFirst().decide(v)


def test_skip_ahead_prefills_while_requests_run_and_decodes_when_nothing_waits() -> None:
    assert SkipAhead().decide(view((waiting(2),), (running(1),))).action == "prefill"
    assert SkipAhead().decide(view((), (running(1),))) == Decision.decode()


def test_skip_ahead_takes_integer_options_as_floats() -> None:
    assert SkipAhead(aging=2, threshold=10) == SkipAhead(aging=2.0, threshold=10.0)


@pytest.mark.parametrize("options", [
    {"aging": 0.0}, {"aging": -1.0}, {"aging": float("nan")}, {"aging": True},
    {"aging": "fast"}, {"threshold": -1.0}, {"threshold": float("inf")},
    {"aging": 1e-320},  # threshold / aging overflows
])
def test_skip_ahead_rejects_options_out_of_range(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="skip_ahead"):
        SkipAhead(**options)


# ---- stall_free ----------------------------------------------------------------------------

def test_stall_free_decodes_everything_and_prefills_in_arrival_order_in_its_budget() -> None:
    v = view((waiting(7, 900, waited=5), waiting(3, 10)), (running(1), running(2)))
    assert StallFree(token_budget=64).decide(v) == Decision.mixed([7, 3], "stop",
                                                                 token_budget=64)
    assert StallFree().decide(v) == Decision.mixed([7, 3], "stop")
    assert StallFree().decide(v).decoding is None  # every running request


def test_stall_free_takes_the_engines_budget_when_nothing_runs_and_decodes_when_none_waits(
        ) -> None:
    assert StallFree(token_budget=8).decide(view((waiting(4, 100),))) == Decision.mixed([4])
    assert StallFree(token_budget=8).decide(view((), (running(1),))) == Decision.decode()


@pytest.mark.parametrize("budget", [0, -3, 2.5, True, "64"])
def test_stall_free_rejects_a_budget_that_is_not_a_positive_integer(budget: Any) -> None:
    with pytest.raises(ConfigError, match="stall_free: option token_budget"):
        StallFree(token_budget=budget)


# ---- lpm -----------------------------------------------------------------------------------

def test_lpm_offers_the_longest_prefix_match_first_ties_in_queue_order_and_stops() -> None:
    v = view((waiting(1, match=0), waiting(2, match=32), waiting(3, match=8),
              waiting(4, match=32)), (running(9),))
    assert LongestPrefixMatch().decide(v) == prefill(2, 4, 3, 1)


def test_lpm_puts_requests_that_waited_max_wait_rounds_first_in_queue_order() -> None:
    v = view((waiting(1, waited=9), waiting(2, match=64, waited=1), waiting(3, waited=8),
              waiting(4, match=16)))
    assert LongestPrefixMatch(max_wait_rounds=8).decide(v) == prefill(1, 3, 2, 4)
    assert LongestPrefixMatch(max_wait_rounds=0).decide(v) == prefill(1, 2, 3, 4)  # FCFS


def test_lpm_offers_no_more_than_the_free_rows_can_take() -> None:
    v = attrs.evolve(view(tuple(waiting(u, match=u) for u in range(20))), free_slots=3)
    assert LongestPrefixMatch().decide(v) == prefill(19, 18, 17, 16)


@pytest.mark.parametrize("rounds", [-1, 1.5, True, "8"])
def test_lpm_rejects_a_max_wait_that_is_not_a_whole_number_of_rounds(rounds: Any) -> None:
    with pytest.raises(ConfigError, match="lpm: option max_wait_rounds"):
        LongestPrefixMatch(max_wait_rounds=rounds)


# ---- every policy: determinism -------------------------------------------------------------

@st.composite
def view_fields(draw: st.DrawFn) -> dict[str, Any]:
    """The fields of a random view, so the same view can be built twice."""
    uids = draw(st.lists(st.integers(0, 50), max_size=8, unique=True))
    wait = []
    for uid in uids:
        prompt_len = draw(st.integers(1, 2000))
        wait.append(dict(uid=uid, prompt_len=prompt_len,
                         prefill_remaining=draw(st.integers(1, prompt_len)),
                         remaining_tokens=draw(st.integers(1, 500)),
                         arrival_round=draw(st.integers(0, 300)),
                         waited_rounds=draw(st.integers(0, 300)), chunked=draw(st.booleans())))
    run = draw(st.lists(st.integers(51, 99), max_size=6, unique=True))
    return dict(
        waiting=wait, running=sorted(run), free_pages=draw(st.integers(0, 100)),
        free_slots=draw(st.integers(0, 8)), token_budget=draw(st.integers(1, 4096)),
        page_size=draw(st.sampled_from([1, 16])), round=draw(st.integers(0, 300)),
        decode_streak=draw(st.integers(0, 10)))


def build_view(fields: dict[str, Any]) -> SchedulerView:
    return SchedulerView(**{
        **fields,
        "waiting": tuple(WaitingRequest(**w) for w in fields["waiting"]),
        "running": tuple(RunningRequest(uid, 10, 5) for uid in fields["running"]),
    })


policy_specs: st.SearchStrategy[tuple[Any, dict[str, Any]]] = st.one_of(
    st.just((PrefillFirst, {})),
    st.builds(lambda n: (DecodeFirst, {"max_decode_rounds": n}), st.integers(1, 12)),
    st.builds(lambda a, t: (SkipAhead, {"aging": a, "threshold": t}),
              st.floats(0.01, 10.0), st.floats(0.0, 500.0)),
    st.builds(lambda b: (StallFree, {"token_budget": b}), st.none() | st.integers(1, 4096)),
    st.builds(lambda n: (LongestPrefixMatch, {"max_wait_rounds": n}), st.integers(0, 300)),
)


@given(view_fields(), policy_specs)
def test_every_policy_decides_the_same_for_the_same_view(
        fields: dict[str, Any], spec: tuple[type[Policy], dict[str, Any]]) -> None:
    cls, options = spec
    assert cls(**options).decide(build_view(fields)) == cls(**options).decide(build_view(fields))


@given(view_fields(), policy_specs)
def test_every_policy_offers_only_waiting_requests_without_repeats(
        fields: dict[str, Any], spec: tuple[type[Policy], dict[str, Any]]) -> None:
    cls, options = spec
    v = build_view(fields)
    decision = cls(**options).decide(v)
    assert len(set(decision.candidates)) == len(decision.candidates)
    assert set(decision.candidates) <= {req.uid for req in v.waiting}
    assert decision.action == "decode" or v.waiting


@given(view_fields(), st.floats(0.01, 10.0), st.floats(0.0, 500.0))
def test_skip_ahead_never_offers_a_young_request_before_an_old_one(
        fields: dict[str, Any], aging: float, threshold: float) -> None:
    policy, v = SkipAhead(aging=aging, threshold=threshold), build_view(fields)
    decision = policy.decide(v)
    assume(decision.action == "prefill")
    waited = {req.uid: req.waited_rounds for req in v.waiting}
    old = [uid for uid in decision.candidates if waited[uid] >= policy.old_after]
    assert old == [req.uid for req in v.waiting if req.uid in old]  # arrival order
    assert list(decision.candidates[:len(old)]) == old
    assert decision.on_misfit == ("stop" if old else "skip")


# ---- registry ------------------------------------------------------------------------------

def test_builtins_are_found_through_the_entry_point_group() -> None:
    found = available_policies()
    for name, cls in BUILTINS.items():
        assert found[name].group == GROUP
        assert found[name].load() is cls
        policy = load_policy(name)
        assert isinstance(policy, cls) and isinstance(policy, Policy) and policy.name == name


def test_available_policies_are_sorted_by_name() -> None:
    assert list(available_policies()) == sorted(available_policies())


def test_load_policy_passes_options_to_the_factory() -> None:
    assert load_policy("skip_ahead", {"aging": 0.5}) == SkipAhead(aging=0.5)
    assert load_policy("decode_first", {"max_decode_rounds": 2}) == DecodeFirst(2)
    assert load_policy("stall_free", {"token_budget": 96}) == StallFree(token_budget=96)


def test_an_unknown_policy_name_is_an_error_that_lists_the_installed_names() -> None:
    with pytest.raises(ConfigError, match="unknown policy 'fastest'") as info:
        load_policy("fastest")
    assert all(name in str(info.value) for name in BUILTINS)


def test_an_unknown_option_is_an_error_naming_the_policy_and_the_option() -> None:
    with pytest.raises(ConfigError, match="'decode_first' has no option 'max_rounds'"):
        load_policy("decode_first", {"max_rounds": 2})


@pytest.mark.parametrize("options", [{"max_decode_rounds": 0}, {"max_decode_rounds": "x"}])
def test_a_bad_option_value_is_an_error_naming_the_policy_and_the_option(
        options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="decode_first: option max_decode_rounds"):
        load_policy("decode_first", options)


def test_a_policy_instance_passes_through() -> None:
    policy = SkipAhead(aging=3.0)
    assert load_policy(policy) is policy


def test_a_policy_instance_with_options_is_an_error() -> None:
    with pytest.raises(ConfigError, match="constructor"):
        load_policy(PrefillFirst(), {"aging": 1.0})


def test_an_object_that_is_not_a_policy_is_rejected() -> None:
    with pytest.raises(ConfigError, match="not a Policy"):
        not_a_policy: Any = object()
        load_policy(not_a_policy)


def plain_factory(*, speed: int = 1) -> PrefillFirst:
    """A factory with no ``options`` table, as a minimal plugin might register."""
    return PrefillFirst()


@pytest.fixture
def fake_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Entry points as third-party plugins would install them, some of them broken."""
    fakes = [EntryPoint(name, value, GROUP) for name, value in [
        ("not_a_policy", "builtins:object"),
        ("missing_module", "no_such_module_for_asyncinfer:Policy"),
        ("plain", "tests.test_policies:plain_factory"),
        ("twice", "asyncinfer.policies.builtin:PrefillFirst"),
        ("twice", "asyncinfer.policies.builtin:DecodeFirst"),
    ]]
    monkeypatch.setattr(registry, "entry_points", lambda group: [
        ep for ep in fakes if ep.group == group])


@pytest.mark.usefixtures("fake_plugins")
@pytest.mark.parametrize(("name", "options", "message"), [
    ("not_a_policy", {}, "'not_a_policy' is not a Policy"),
    ("missing_module", {}, "'missing_module' .* failed to load: ModuleNotFoundError"),
    ("plain", {"turbo": True}, "policy 'plain': bad options .*turbo"),
    ("twice", {}, "'twice' is registered more than once"),
])
def test_a_broken_plugin_is_a_config_error(name: str, options: dict[str, Any],
                                           message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_policy(name, options)


@pytest.mark.usefixtures("fake_plugins")
def test_a_plain_factory_plugin_loads() -> None:
    assert load_policy("plain", {"speed": 3}) == PrefillFirst()


@pytest.mark.parametrize(("pairs", "expected"), [
    ([], {}),
    (["max_decode_rounds=4"], {"max_decode_rounds": 4}),
    (["aging=0.5", "threshold=1e2"], {"aging": 0.5, "threshold": 100.0}),
    (["eager=true", "lazy=False"], {"eager": True, "lazy": False}),
    (["mode=fast", "empty="], {"mode": "fast", "empty": ""}),
    ([" aging = -2 "], {"aging": -2}),
    (["expr=a=b"], {"expr": "a=b"}),
])
def test_parse_policy_options(pairs: list[str], expected: dict[str, Any]) -> None:
    assert parse_policy_options(pairs) == expected
    assert [type(v) for v in parse_policy_options(pairs).values()] == [
        type(v) for v in expected.values()]


@pytest.mark.parametrize("pairs", [["aging"], ["=1"], ["two words=1"], ["a=1", "a=2"]])
def test_parse_policy_options_rejects_malformed_pairs(pairs: list[str]) -> None:
    with pytest.raises(ConfigError, match="policy option"):
        parse_policy_options(pairs)


def test_describe_policies_names_each_policy_its_summary_and_its_options() -> None:
    text = describe_policies()
    for name, cls in BUILTINS.items():
        assert name in text
        assert (cls.__doc__ or "").splitlines()[0] in text
    assert "max_decode_rounds=4" in text
    assert "aging=1.0" in text and "threshold=64.0" in text
