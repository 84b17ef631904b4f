"""The traffic `asyncinfer bench serve` draws: length distributions, arrival processes and
label mixes, each from a ``random.Random`` stream of its own (docs/workloads.md)."""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterator, Mapping
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
        return (self.lo + self.hi) / 2

    def describe(self) -> dict[str, Any]:
        return {"dist": "uniform", "lo": self.lo, "hi": self.hi}


def _phi(z: float) -> float:
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


@frozen
class LogNormal:
    """Lognormal lengths of mean ``mean`` and log-deviation ``sigma``, clipped to ``lo..hi``."""

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
        return math.log(self.mean) - self.sigma**2 / 2

    def sample(self, rng: random.Random) -> int:
        return min(self.hi, max(self.lo, round(rng.lognormvariate(self.mu, self.sigma))))

    def expected(self) -> float:
        """The mean after clipping (rounding moves it by under half a token)."""
        a, b, s = math.log(self.lo), math.log(self.hi), self.sigma
        below, above = _phi((a - self.mu) / s), 1 - _phi((b - self.mu) / s)
        # E[X; lo < X < hi] of a lognormal: mean * (Phi(b') - Phi(a')), shifted by sigma.
        inside = self.mean * (_phi((b - self.mu - s * s) / s) - _phi((a - self.mu - s * s) / s))
        return self.lo * below + self.hi * above + inside

    def describe(self) -> dict[str, Any]:
        return {"dist": "lognormal", "mean": self.mean, "sigma": self.sigma, "lo": self.lo,
                "hi": self.hi, "mean_after_clipping": round(self.expected(), 1)}


LengthDist = Uniform | LogNormal

# ShareGPT's means as the vLLM paper reports them; the sigmas are ours (docs/workloads.md).
CHAT_INPUT = LogNormal(161.0, 1.0, 4, 2048)
CHAT_OUTPUT = LogNormal(338.0, 0.8, 4, 1024)
WORKLOADS = ("uniform", "chat")


def chat(input_mean: float | None = None,
         output_mean: float | None = None) -> tuple[LogNormal, LogNormal]:
    """The ``chat`` prompt and output lengths, their means overridden where given."""
    inp = CHAT_INPUT if input_mean is None else LogNormal(input_mean, CHAT_INPUT.sigma,
                                                          CHAT_INPUT.lo, CHAT_INPUT.hi)
    out = CHAT_OUTPUT if output_mean is None else LogNormal(output_mean, CHAT_OUTPUT.sigma,
                                                            CHAT_OUTPUT.lo, CHAT_OUTPUT.hi)
    return inp, out


def _gaps(rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    """Gaps of mean ``1/rate``: exponential for ``burstiness`` 1 (Poisson), else gamma of that
    shape (coefficient of variation ``1/sqrt(burstiness)``)."""
    if burstiness == 1:
        while True:
            yield rng.expovariate(rate)
    while True:
        yield rng.gammavariate(burstiness, 1 / (rate * burstiness))


def arrival_times(num_requests: int, rate: float, rng: random.Random,
                  burstiness: float = 1.0) -> list[float]:
    """Send times: the first at 0, then gaps from ``_gaps``; all at 0 for an infinite rate."""
    if math.isinf(rate) or num_requests == 0:
        return [0.0] * num_requests
    gaps = _gaps(rate, burstiness, rng)
    return list(itertools.accumulate((next(gaps) for _ in range(num_requests - 1)),
                                     initial=0.0))


def tenant_arrivals(rates: Mapping[str, float], num_requests: int, seed: int,
                    burstiness: float = 1.0) -> list[tuple[float, str]]:
    """The first ``num_requests`` (time, tenant) arrivals of one process per tenant, merged in
    time order and shifted to start at 0; each tenant sends until the last request."""

    def process(name: str, rate: float) -> Iterator[tuple[float, str]]:
        rng = random.Random(f"arrivals-{seed}-{name}")
        return ((t, name) for t in itertools.accumulate(_gaps(rate, burstiness, rng)))

    merged = heapq.merge(*(process(name, rate) for name, rate in rates.items()))
    arrivals = list(itertools.islice(merged, num_requests))
    start = arrivals[0][0] if arrivals else 0.0
    return [(t - start, name) for t, name in arrivals]


def draw_labels(shares: Mapping[K, float], num_requests: int, stream: str) -> list[K]:
    """Each request's label, drawn with weights ``shares`` from ``random.Random(stream)``."""
    names = list(shares)
    return random.Random(stream).choices(names, weights=[shares[k] for k in names],
                                         k=num_requests)


def parse_mix(text: str, key: Callable[[str], K], what: str,
              name: str = "NAME") -> dict[K, float]:
    """``"A:0.8,B:0.2"`` as ``{"A": 0.8, "B": 0.2}``, keys through ``key``, values finite
    and > 0; otherwise a ValueError that says what is wrong."""
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
