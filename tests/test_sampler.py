"""The sampler: filters keep exactly their defined support; seeded requests ignore their batch."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from torch import Tensor

from asyncinfer.engine.sampler import (
    Sampler,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    request_seed,
)
from asyncinfer.errors import InvalidRequestError
from asyncinfer.params import MIN_TEMPERATURE, SamplingParams

FAST = settings(max_examples=100, deadline=None)


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    # On tensors this small, OpenMP fork/join costs milliseconds per op on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Half-integers collide often, so rows carry ties; -inf gives tokens of probability zero.
_LOGIT = st.one_of(
    st.sampled_from([-math.inf] + [x / 2 for x in range(-8, 9)]),
    st.floats(-6.0, 6.0, width=32),
)


def _unmask_empty_rows(logits: np.ndarray) -> np.ndarray:
    logits[~np.isfinite(logits).any(axis=-1)] = 0.0
    return logits


def logit_batches(
    max_batch: int = 4, max_vocab: int = 12, min_vocab: int = 1
) -> st.SearchStrategy[np.ndarray]:
    """A float32 [B, V] batch of logits with ties and masked tokens, no row fully masked."""
    shape = st.tuples(st.integers(1, max_batch), st.integers(min_vocab, max_vocab))
    return hnp.arrays(np.float32, shape, elements=_LOGIT).map(_unmask_empty_rows)


def _probs(logits: np.ndarray) -> Tensor:
    return torch.softmax(torch.from_numpy(logits), dim=-1)


def sampling_params(
    vocab: int, seed: st.SearchStrategy[int | None]
) -> st.SearchStrategy[SamplingParams]:
    """Any valid SamplingParams, greedy ones included."""
    return st.builds(
        SamplingParams,
        temperature=st.one_of(st.just(0.0), st.floats(0.05, 2.0)),
        top_k=st.integers(-1, vocab + 1),
        top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
        min_p=st.one_of(st.just(0.0), st.floats(0.0, 0.9)),
        seed=seed,
    )


_ANY_SEED = st.one_of(st.none(), st.integers(-(2**40), 2**40))


@FAST
@given(logit_batches(), st.data())
def test_top_k_keeps_exactly_tokens_with_fewer_than_k_strictly_more_probable(
    logits: np.ndarray, data: st.DataObject
) -> None:
    probs = _probs(logits)
    batch, vocab = probs.shape
    ks = data.draw(st.lists(st.integers(-1, vocab + 1), min_size=batch, max_size=batch))
    out = apply_top_k(probs, torch.tensor(ks))
    for row, k, kept in zip(probs.tolist(), ks, out.tolist(), strict=True):
        off = k <= 0 or k >= vocab
        expected = [p > 0 and (off or sum(u > p for u in row) < k) for p in row]
        assert [q > 0 for q in kept] == expected


@FAST
@given(logit_batches(), st.data())
def test_top_p_keeps_exactly_tokens_whose_strictly_greater_mass_is_below_p(
    logits: np.ndarray, data: st.DataObject
) -> None:
    probs = _probs(logits)
    batch = probs.shape[0]
    p_value = st.one_of(st.just(1.0), st.floats(0.0, 1.0, exclude_min=True))
    ps = data.draw(st.lists(p_value, min_size=batch, max_size=batch))
    out = apply_top_p(probs, torch.tensor(ps, dtype=torch.float64))
    for row, p, kept in zip(probs.tolist(), ps, out.tolist(), strict=True):
        greater = [math.fsum(u for u in row if u > q) for q in row]
        if p < 1.0:
            # Within rounding of p, float64 summation order is allowed to decide.
            assume(all(abs(g - p) > 1e-9 for g in greater))
        expected = [q > 0 and (p >= 1.0 or g < p) for q, g in zip(row, greater, strict=True)]
        assert [q > 0 for q in kept] == expected


@FAST
@given(logit_batches(), st.data())
def test_min_p_keeps_exactly_tokens_at_least_min_p_times_the_max(
    logits: np.ndarray, data: st.DataObject
) -> None:
    probs = _probs(logits)
    batch = probs.shape[0]
    min_ps = data.draw(st.lists(st.floats(0.0, 1.0), min_size=batch, max_size=batch))
    out = apply_min_p(probs, torch.tensor(min_ps, dtype=torch.float64))
    for row, m, kept in zip(probs.tolist(), min_ps, out.tolist(), strict=True):
        expected = [q > 0 and (m <= 0 or q >= m * max(row)) for q in row]
        assert [q > 0 for q in kept] == expected


_FILTERS: dict[str, tuple[Callable[[Tensor, Tensor], Tensor], st.SearchStrategy[float]]] = {
    "top_k": (apply_top_k, st.integers(-1, 13).map(float)),
    "top_p": (apply_top_p, st.floats(0.0, 1.0, exclude_min=True)),
    "min_p": (apply_min_p, st.floats(0.0, 1.0)),
}


@pytest.mark.parametrize("name", sorted(_FILTERS))
@FAST
@given(logits=logit_batches(), data=st.data())
def test_filtered_rows_sum_to_one_on_a_subset_of_the_original_support(
    name: str, logits: np.ndarray, data: st.DataObject
) -> None:
    apply, value = _FILTERS[name]
    probs = _probs(logits)
    values = data.draw(st.lists(value, min_size=probs.shape[0], max_size=probs.shape[0]))
    param = torch.tensor(values, dtype=torch.float64)
    out = apply(probs, param.long() if name == "top_k" else param)
    assert torch.allclose(out.sum(dim=-1), torch.ones(out.shape[0]), atol=1e-5)
    assert bool(((out > 0) <= (probs > 0)).all())
    assert bool((out >= 0).all())


@st.composite
def batches_with_params(draw: st.DrawFn) -> tuple[Tensor, list[SamplingParams], list[int]]:
    """Logits, per-row params (greedy, seeded and unseeded mixed) and per-row steps."""
    logits = draw(logit_batches())
    batch, vocab = logits.shape
    params = draw(st.lists(sampling_params(vocab, _ANY_SEED), min_size=batch, max_size=batch))
    steps = draw(st.lists(st.integers(0, 10_000), min_size=batch, max_size=batch))
    return torch.from_numpy(logits), params, steps


@FAST
@given(batches_with_params(), st.integers(0, 2**32))
def test_greedy_rows_take_the_argmax(
    batch: tuple[Tensor, list[SamplingParams], list[int]], sampler_seed: int
) -> None:
    logits, params, steps = batch
    tokens = Sampler(sampler_seed).sample(logits, params, steps)
    for i, p in enumerate(params):
        if p.greedy:
            assert logits[i, tokens[i]] == logits[i].max()


@FAST
@given(batches_with_params(), st.integers(0, 2**32))
def test_sampled_tokens_have_nonzero_probability_after_the_filters(
    batch: tuple[Tensor, list[SamplingParams], list[int]], sampler_seed: int
) -> None:
    logits, params, steps = batch
    tokens = Sampler(sampler_seed).sample(logits, params, steps)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = torch.softmax(logits[i : i + 1] / p.temperature, dim=-1)
        probs = apply_top_k(probs, torch.tensor([p.top_k]))
        probs = apply_top_p(probs, torch.tensor([p.top_p], dtype=torch.float64))
        probs = apply_min_p(probs, torch.tensor([p.min_p], dtype=torch.float64))
        assert probs[0, tokens[i]] > 0


@st.composite
def seeded_request_among_strangers(
    draw: st.DrawFn,
) -> tuple[Tensor, list[SamplingParams], list[int], int]:
    """A batch whose row ``position`` is a seeded, non-greedy request; the others are anything."""
    logits = draw(logit_batches(max_batch=6, min_vocab=2))
    batch, vocab = logits.shape
    position = draw(st.integers(0, batch - 1))
    params = draw(st.lists(sampling_params(vocab, _ANY_SEED), min_size=batch, max_size=batch))
    seeded = sampling_params(vocab, st.integers(-(2**40), 2**40)).filter(lambda p: not p.greedy)
    params[position] = draw(seeded)
    steps = draw(st.lists(st.integers(0, 10_000), min_size=batch, max_size=batch))
    return torch.from_numpy(logits), params, steps, position


@FAST
@given(seeded_request_among_strangers(), st.integers(0, 2**32), st.integers(0, 2**32))
def test_seeded_request_samples_the_same_token_whatever_its_batch_holds(
    case: tuple[Tensor, list[SamplingParams], list[int], int], seed_a: int, seed_b: int
) -> None:
    logits, params, steps, i = case
    alone = Sampler(seed_a).sample(logits[i : i + 1], [params[i]], [steps[i]])
    shared = Sampler(seed_b).sample(logits, params, steps)
    assert alone[0] == shared[i]


def test_request_seed_is_fixed_integer_arithmetic() -> None:
    # Pinned: a change here changes every seeded request's tokens from one release to the next.
    assert request_seed(0, 0) == 12035550249420947055
    assert request_seed(-5, 3) == 2977657682297242744
    assert request_seed(2**64 + 7, 11) == request_seed(7, 11)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_sample_returns_int64_tokens_for_any_float_logits(dtype: torch.dtype) -> None:
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0)).to(dtype)
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=3), SamplingParams(top_p=0.5)]
    tokens = Sampler().sample(logits, params, [0, 1, 2])
    assert tokens.dtype == torch.int64 and tokens.shape == (3,)


@pytest.mark.parametrize("seed", [None, 1234])
def test_sample_frequencies_match_the_distribution(seed: int | None) -> None:
    distribution = [0.1, 0.2, 0.3, 0.4]
    draws = 2000
    logits = torch.tensor(distribution).log().expand(draws, -1)
    params = [SamplingParams(seed=seed)] * draws
    tokens = Sampler(seed=0).sample(logits, params, list(range(draws)))
    counts = torch.bincount(tokens, minlength=len(distribution)).tolist()
    expected = [draws * p for p in distribution]
    chi_square = sum((c - e) ** 2 / e for c, e in zip(counts, expected, strict=True))
    # 16.27 is the 0.999 quantile of chi-square with 3 degrees of freedom.
    assert chi_square < 16.27, counts


@pytest.mark.parametrize(("name", "value"), [
    ("max_tokens", 0), ("max_tokens", 2**31), ("max_tokens", 2.0),
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -1e-9),
    ("temperature", 100.5), ("temperature", "1"), ("temperature", 10**400),
    ("top_p", math.nan), ("top_p", math.inf), ("top_p", 0.0), ("top_p", 1.5),
    ("min_p", math.nan), ("min_p", -math.inf), ("min_p", 1.1),
    ("top_k", -2), ("top_k", 2**31), ("top_k", 10**19), ("top_k", 1.5), ("top_k", True),
    ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 1.0),
])
def test_out_of_range_values_are_refused_naming_the_field(name: str, value: object) -> None:
    with pytest.raises(InvalidRequestError, match=rf"^{name} ") as refused:
        SamplingParams(**{name: value})
    assert refused.value.param == name


def test_range_ends_are_accepted_and_tiny_temperatures_are_greedy() -> None:
    for top_k in (-1, 0, 2**31 - 1):
        SamplingParams(top_k=top_k)
    for seed in (-(2**63), 2**64 - 1):
        SamplingParams(seed=seed)
    SamplingParams(max_tokens=2**31 - 1, temperature=100.0)
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-40).greedy
    assert SamplingParams(temperature=MIN_TEMPERATURE / 2).greedy
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy


@pytest.mark.parametrize("filtered", [False, True], ids=["fused", "filtered"])
def test_extreme_values_sample_beside_others_and_tiny_temperatures_take_the_argmax(
        filtered: bool) -> None:
    vocab = 50
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(4)) * 5
    params = [SamplingParams(temperature=0.0),
              SamplingParams(temperature=1e-40),
              SamplingParams(temperature=MIN_TEMPERATURE / 2, seed=5),
              SamplingParams(top_k=2**31 - 1, seed=2**64 - 1),
              SamplingParams(top_k=vocab + 5),
              SamplingParams(temperature=2.0, seed=-(2**63)),
              SamplingParams(temperature=MIN_TEMPERATURE),
              SamplingParams(top_k=5, top_p=0.9, min_p=0.01) if filtered
              else SamplingParams(top_k=vocab)]
    tokens = Sampler(1).sample(logits, params, list(range(8)))
    assert tokens[:3].tolist() == logits[:3].argmax(dim=-1).tolist()
    for i in (0, 3, 5):  # the same whatever shares the batch
        assert tokens[i] == Sampler(2).sample(logits[i : i + 1], params[i : i + 1], [i])[0]
    assert ((tokens >= 0) & (tokens < vocab)).all()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(0, 40),
       p=st.floats(0.05, 1.0), m=st.floats(0.0, 0.5))
def test_filters_keep_the_same_tokens_with_their_weights_unscaled(seed: int, k: int, p: float,
                                                                  m: float) -> None:
    """The batch-invariant mode's filters (``scale=False``, no sum over the row): top-k, then
    top-p over what top-k kept, then min-p keep exactly the tokens the scaled chain keeps, in
    the same proportions."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(3, 64, generator=gen) * 3, dim=-1)
    chains = []
    for scale in (True, False):
        out = apply_top_k(probs, torch.tensor([k, 5, 64]), scale)
        out = apply_top_p(out, torch.tensor([p, 0.5, 1.0], dtype=torch.float64), scale)
        chains.append(apply_min_p(out, torch.tensor([m, 0.0, 0.1], dtype=torch.float64),
                                  scale))
    scaled, unscaled = chains
    assert torch.equal(scaled > 0, unscaled > 0)
    torch.testing.assert_close(unscaled / unscaled.sum(-1, keepdim=True), scaled)
