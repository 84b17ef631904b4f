"""Workloads of `asyncinfer bench serve` that stand for real traffic, and the service each
tenant got.

Lengths are uniform or lognormal (``chat``: a fit of the ShareGPT statistics the vLLM paper
publishes); arrivals are Poisson or gamma (bursty) processes, one per tenant if asked; mixes
of tenants and priorities are drawn per request. Each draw has a ``random.Random`` stream of
its own, keyed by the run's seed, so that adding one (a tenant mix, say) leaves the prompts
and the arrival times as they were. docs/workloads.md states the distributions, their
parameters and their sources, and the service measure.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from attrs import field, frozen

K = TypeVar("K")


@frozen
class Uniform:
    """Integers uniform in ``lo..hi``, both included."""

    lo: int
    hi: int

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    def expected(self) -> float:
        """The mean of the draws."""
        return (self.lo + self.hi) / 2

    def describe(self) -> dict[str, Any]:
        return {"dist": "uniform", "lo": self.lo, "hi": self.hi}


def _phi(z: float) -> float:
    """The standard normal distribution function."""
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


@frozen
class LogNormal:
    """Lengths whose logarithm is normal with deviation ``sigma``, placed so that the mean
    is ``mean`` (``mu = ln(mean) - sigma**2 / 2``), rounded to the nearest integer and
    clipped to ``lo..hi``: a long right tail, as measured prompt and answer lengths have."""

    mean: float = field()
    sigma: float = field()
    lo: int = 1
    hi: int = 2**31 - 1

    @mean.validator
    def _positive_mean(self, attribute: Any, value: float) -> None:
        if not value > 0:
            raise ValueError(f"a lognormal mean must be > 0, got {value}")

    @sigma.validator
    def _positive_sigma(self, attribute: Any, value: float) -> None:
        if not value > 0:
            raise ValueError(f"a lognormal sigma must be > 0, got {value}")

    @property
    def mu(self) -> float:
        """The mean of the logarithm."""
        return math.log(self.mean) - self.sigma**2 / 2

    def sample(self, rng: random.Random) -> int:
        return min(self.hi, max(self.lo, round(rng.lognormvariate(self.mu, self.sigma))))

    def expected(self) -> float:
        """The mean after clipping (rounding moves it by less than half a token): clipping
        ``hi`` takes the tail's excess off ``mean``, clipping ``lo`` adds a little."""
        a, b, s = math.log(self.lo), math.log(self.hi), self.sigma
        below, above = _phi((a - self.mu) / s), 1 - _phi((b - self.mu) / s)
        # E[X; lo < X < hi] of a lognormal: mean * (Phi(b') - Phi(a')), shifted by sigma.
        inside = self.mean * (_phi((b - self.mu - s * s) / s) - _phi((a - self.mu - s * s) / s))
        return self.lo * below + self.hi * above + inside

    def describe(self) -> dict[str, Any]:
        return {"dist": "lognormal", "mean": self.mean, "sigma": self.sigma, "lo": self.lo,
                "hi": self.hi, "mean_after_clipping": round(self.expected(), 1)}


LengthDist = Uniform | LogNormal

# ShareGPT as the vLLM paper reports it (Kwon et al., SOSP'23, section 6.1 and figure 11):
# mean prompt 161 tokens, mean output 338. The sigmas are ours (the paper gives histograms,
# not variances): see docs/workloads.md.
CHAT_INPUT = LogNormal(161.0, 1.0, 4, 2048)
CHAT_OUTPUT = LogNormal(338.0, 0.8, 4, 1024)
WORKLOADS = ("uniform", "chat")


def chat(input_mean: float | None = None,
         output_mean: float | None = None) -> tuple[LogNormal, LogNormal]:
    """The ``chat`` workload's prompt and output lengths, with their means overridden when
    given (the sigmas and clip bounds stay)."""
    inp = CHAT_INPUT if input_mean is None else LogNormal(input_mean, CHAT_INPUT.sigma,
                                                          CHAT_INPUT.lo, CHAT_INPUT.hi)
    out = CHAT_OUTPUT if output_mean is None else LogNormal(output_mean, CHAT_OUTPUT.sigma,
                                                            CHAT_OUTPUT.lo, CHAT_OUTPUT.hi)
    return inp, out


def _gaps(rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    """Inter-arrival gaps of mean ``1/rate``: exponential for ``burstiness`` 1 (Poisson),
    else gamma of shape ``burstiness``, whose coefficient of variation is
    ``1/sqrt(burstiness)``: below 1, arrivals come in clumps with longer lulls between."""
    if burstiness == 1:
        while True:
            yield rng.expovariate(rate)
    while True:
        yield rng.gammavariate(burstiness, 1 / (rate * burstiness))


def arrival_times(num_requests: int, rate: float, rng: random.Random,
                  burstiness: float = 1.0) -> list[float]:
    """The first at 0, then ``num_requests - 1`` more gaps of mean ``1/rate`` (see
    ``_gaps``); all at 0 for an infinite rate."""
    if math.isinf(rate) or num_requests == 0:
        return [0.0] * num_requests
    gaps = _gaps(rate, burstiness, rng)
    return list(itertools.accumulate((next(gaps) for _ in range(num_requests - 1)),
                                     initial=0.0))


def tenant_arrivals(rates: Mapping[str, float], num_requests: int, seed: int,
                    burstiness: float = 1.0) -> list[tuple[float, str]]:
    """The first ``num_requests`` arrivals of independent processes, one per tenant at its
    own rate (each from a stream of its own), merged in time order, as (time, tenant).

    Each process starts one gap after 0, as a process already running would; the merged
    schedule is then shifted to start at 0. Every tenant keeps sending until the last
    request, so each one's load is steady over the whole run."""

    def process(name: str, rate: float) -> Iterator[tuple[float, str]]:
        rng = random.Random(f"arrivals-{seed}-{name}")
        return ((t, name) for t in itertools.accumulate(_gaps(rate, burstiness, rng)))

    merged = heapq.merge(*(process(name, rate) for name, rate in rates.items()))
    arrivals = list(itertools.islice(merged, num_requests))
    start = arrivals[0][0] if arrivals else 0.0
    return [(t - start, name) for t, name in arrivals]


def draw_labels(shares: Mapping[K, float], num_requests: int, stream: str) -> list[K]:
    """Each request's label, drawn independently with probabilities proportional to
    ``shares`` from ``random.Random(stream)``."""
    names = list(shares)
    return random.Random(stream).choices(names, weights=[shares[k] for k in names],
                                         k=num_requests)


def parse_mix(text: str, key: Callable[[str], K], what: str,
              name: str = "NAME") -> dict[K, float]:
    """``"A:0.8,B:0.2"`` as ``{"A": 0.8, "B": 0.2}``: each key through ``key`` (ValueError:
    not a ``name``), each value a finite number > 0 (a ``what``); a ValueError that says
    what is wrong otherwise."""
    form = f"expected {name}:{what.upper()},..."
    mix: dict[K, float] = {}
    for item in text.split(","):
        head, sep, number = item.strip().partition(":")
        if not sep:
            raise ValueError(f"{form} got {text!r} (no ':' in {item.strip()!r})")
        try:
            label = key(head.strip())
        except ValueError:
            raise ValueError(f"{form} got {text!r} (bad {name} {head.strip()!r})") from None
        try:
            value = float(number)
        except ValueError:
            value = math.nan
        if not 0 < value < math.inf:
            raise ValueError(f"{form} with each {what} a finite number > 0, got "
                             f"{number.strip()!r} in {text!r}")
        if label in mix:
            raise ValueError(f"{form} got {head.strip()!r} twice in {text!r}")
        mix[label] = value
    return mix


def tenant_name(text: str) -> str:
    """A tenant name: anything but empty (``:`` and ``,`` separate the spec)."""
    if not text:
        raise ValueError("empty tenant name")
    return text


# --- Service: what each tenant got over time ---------------------------------------------------

Interval = tuple[float, float]


def _by_time(events: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    return sorted(events)


@frozen
class TenantTrace:
    """What one tenant received: ``events`` (time, weighted service), kept sorted by time,
    and the intervals in which one of its requests waited for its first token
    (``backlog``)."""

    events: list[tuple[float, float]] = field(converter=_by_time)
    backlog: Sequence[Interval] = ()


def union(intervals: Sequence[Interval]) -> list[Interval]:
    """The disjoint, sorted intervals covering ``intervals`` (touching ones joined)."""
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Where two sets of disjoint, sorted intervals overlap (for more than an instant)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def cumulative(events: Sequence[tuple[float, float]], times: Sequence[float]) -> list[float]:
    """Service received up to and including each of ``times`` (sorted)."""
    out, total, k = [], 0.0, 0
    for t in times:
        while k < len(events) and events[k][0] <= t:
            total += events[k][1]
            k += 1
        out.append(total)
    return out


def largest_gap(a: TenantTrace, b: TenantTrace) -> dict[str, Any]:
    """The largest ``|ΔW_a - ΔW_b|`` over ``(t1, t2]``, t1 < t2 in one interval where both
    were backlogged, ``W`` being the cumulative service: ``D = W_a - W_b`` steps only at
    events, so over an interval that is max D - min D at its start and its events.

    Returns ``gap`` (0 when never both backlogged), ``from_s`` and ``to_s`` (where it is
    attained; None then), ``ahead`` (which tenant got more there) and ``backlogged_s`` (how
    long both were backlogged)."""
    together = intersect(union(a.backlog), union(b.backlog))
    steps = sorted([(t, w) for t, w in a.events] + [(t, -w) for t, w in b.events])
    times = [t for t, _ in steps]
    level = list(itertools.accumulate((d for _, d in steps), initial=0.0))  # D after k steps
    best: dict[str, Any] = {"gap": 0.0, "from_s": None, "to_s": None, "ahead": None}
    for start, end in together:
        first = bisect.bisect_right(times, start)  # steps up to start are in D(start)
        last = bisect.bisect_right(times, end)
        points = [(start, level[first])] + [(times[k], level[k + 1])
                                            for k in range(first, last)]
        high = max(points, key=lambda p: p[1])
        low = min(points, key=lambda p: p[1])
        if high[1] - low[1] > best["gap"]:
            t1, t2 = sorted((high[0], low[0]))
            rising = high[0] > low[0]  # D went up: a got more than b over (t1, t2]
            best = {"gap": high[1] - low[1], "from_s": t1, "to_s": t2,
                    "ahead": "a" if rising else "b"}
    best["backlogged_s"] = sum(end - start for start, end in together)
    return best


def service_report(traces: Mapping[str, TenantTrace], bucket: float) -> dict[str, Any]:
    """Each tenant's cumulative service sampled every ``bucket`` seconds from 0 past the last
    event, its total, and for each pair of tenants the largest service gap while both were
    backlogged (see ``largest_gap``); ``max_gap`` is the largest of the pairs'."""
    last = max((t for trace in traces.values() for t, _ in trace.events), default=0.0)
    times = [i * bucket for i in range(math.floor(last / bucket) + 2)]
    pairs = []
    for x, y in itertools.combinations(sorted(traces), 2):
        gap = largest_gap(traces[x], traces[y])
        ahead = {"a": x, "b": y}.get(gap.pop("ahead"))
        pairs.append({"tenants": [x, y], **gap, "ahead": ahead})
    return {"bucket_s": bucket, "times_s": times,
            "cumulative": {name: cumulative(traces[name].events, times)
                           for name in sorted(traces)},
            "total": {name: sum(w for _, w in traces[name].events) for name in sorted(traces)},
            "pairs": pairs,
            "max_gap": max(pairs, key=lambda p: p["gap"], default=None)}
