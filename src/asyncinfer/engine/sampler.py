"""Next-token sampling for a batch: temperature, top-k, top-p, min-p and per-request seeds."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from asyncinfer.engine.transfer import upload
from asyncinfer.params import SamplingParams

_MASK64 = (1 << 64) - 1


def _renormalize(probs: Tensor, keep: Tensor, off: Tensor) -> Tensor:
    kept = probs * keep
    renormed = kept / kept.sum(dim=-1, keepdim=True)
    # Rows with the filter off stay bit-identical, so one row's filter cannot move another
    # row's draw (a seeded request must sample the same token whatever shares its batch).
    return torch.where(off.unsqueeze(-1), probs, renormed)


def apply_top_k(probs: Tensor, top_k: Tensor) -> Tensor:
    """Keep token t iff fewer than k tokens are strictly more probable than t; renormalize.

    Ties at the k-th value are all kept. ``k <= 0`` or ``k >= V`` turns the filter off.
    """
    vocab = probs.shape[-1]
    top_k = top_k.to(device=probs.device, dtype=torch.int64)
    off = (top_k <= 0) | (top_k >= vocab)
    # "Fewer than k strictly greater" is exactly "at least the k-th largest value".
    descending = probs.sort(dim=-1, descending=True).values
    kth = descending.gather(-1, (top_k.clamp(1, vocab) - 1).unsqueeze(-1))
    return _renormalize(probs, probs >= kth, off)


def apply_top_p(probs: Tensor, top_p: Tensor) -> Tensor:
    """Keep token t iff the mass of tokens strictly more probable than t is < p; renormalize.

    The most probable tokens are always kept; ``p >= 1`` turns the filter off.
    """
    top_p = top_p.to(device=probs.device, dtype=torch.float64)
    off = top_p >= 1.0
    wide = probs.double()  # float64 sums keep the mass within ~1e-15 of the exact one
    ascending = wide.sort(dim=-1).values
    # suffix[:, j] = mass of ascending[:, j:], summed from the largest down; suffix[:, V] = 0.
    suffix = ascending.flip(-1).cumsum(-1).flip(-1)
    suffix = torch.cat([suffix, torch.zeros_like(suffix[:, :1])], dim=-1)
    # Index of the first value > p_t, whatever the order of equal values.
    first_greater = torch.searchsorted(ascending, wide, right=True)
    greater_mass = suffix.gather(-1, first_greater)
    return _renormalize(probs, greater_mass < top_p.unsqueeze(-1), off)


def apply_min_p(probs: Tensor, min_p: Tensor) -> Tensor:
    """Keep token t iff ``p_t >= min_p * max_u p_u`` (compared in float64); renormalize.

    ``min_p <= 0`` turns the filter off.
    """
    min_p = min_p.to(device=probs.device, dtype=torch.float64)
    off = min_p <= 0.0
    wide = probs.double()
    threshold = min_p.unsqueeze(-1) * wide.max(dim=-1, keepdim=True).values
    return _renormalize(probs, wide >= threshold, off)


def device_tensor(values: Sequence[float] | Sequence[int], dtype: torch.dtype,
                  device: torch.device) -> Tensor:
    """A small host list on ``device`` without blocking the host (see engine/transfer.py)."""
    return upload(torch.tensor(values, dtype=dtype), device)


def _mix64(x: int) -> int:
    """One splitmix64 step: a bijection on 64-bit integers that spreads every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def request_seed(seed: int, step: int) -> int:
    """The generator seed for a seeded request's ``step``-th token, the same in every process.

    Plain integer arithmetic (no ``hash()``); seeds are taken modulo 2**64.
    """
    return _mix64((_mix64(seed & _MASK64) + step) & _MASK64)


class Sampler:
    """Picks one token per row of a logits batch, following each request's SamplingParams.

    Greedy rows take the argmax; the others are drawn by the exponential race
    ``argmax(probs / E)``, ``E ~ Exp(1)``, with E from the request's own stream when seeded.
    """

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def sample(
        self, logits: Tensor, params: Sequence[SamplingParams], steps: Sequence[int]
    ) -> Tensor:
        """Sample a token per row of ``logits`` [B, V]; ``steps[i]`` counts row i's earlier tokens.

        Returns int64 token ids [B] on the logits' device.
        """
        assert logits.dim() == 2, f"logits must be [B, V], got {tuple(logits.shape)}"
        assert logits.shape[0] == len(params) == len(steps), "one params and step per row"
        logits = logits.float()
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return logits.argmax(dim=-1)
        chosen = [params[i] for i in rows]
        if len(rows) == len(params):  # every row samples: no gather, no scatter
            probs = self._filtered_probs(logits, chosen)
            return (probs / self._exponential_noise(probs, chosen, steps)).argmax(dim=-1)
        tokens = logits.argmax(dim=-1)
        index = device_tensor(rows, torch.int64, logits.device)
        probs = self._filtered_probs(logits[index], chosen)
        noise = self._exponential_noise(probs, chosen, [steps[i] for i in rows])
        tokens[index] = (probs / noise).argmax(dim=-1)
        return tokens

    def _filtered_probs(self, logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
        device, vocab = logits.device, logits.shape[-1]
        temperature = device_tensor([p.temperature for p in params], torch.float32, device)
        probs = torch.softmax(logits / temperature.unsqueeze(-1), dim=-1)
        if any(0 < p.top_k < vocab for p in params):
            probs = apply_top_k(probs, device_tensor([p.top_k for p in params], torch.int64,
                                                     device))
        if any(p.top_p < 1.0 for p in params):
            top_p = device_tensor([p.top_p for p in params], torch.float64, device)
            probs = apply_top_p(probs, top_p)
        if any(p.min_p > 0.0 for p in params):
            min_p = device_tensor([p.min_p for p in params], torch.float64, device)
            probs = apply_min_p(probs, min_p)
        return probs

    def _exponential_noise(
        self, probs: Tensor, params: Sequence[SamplingParams], steps: Sequence[int]
    ) -> Tensor:
        device, vocab = probs.device, probs.shape[-1]
        noise = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            draws = torch.empty(len(unseeded), vocab, device=device)
            draws.exponential_(generator=self._generator(device))
            noise[device_tensor(unseeded, torch.int64, device)] = draws
        for i, (p, step) in enumerate(zip(params, steps, strict=True)):
            if p.seed is not None:
                generator = torch.Generator(device=device)
                generator.manual_seed(request_seed(p.seed, step))
                noise[i] = torch.empty(vocab, device=device).exponential_(generator=generator)
        # A zero draw would turn p / E into 0 / 0 = NaN, which argmax would pick.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(self._seed)
            self._generators[device] = generator
        return self._generators[device]
