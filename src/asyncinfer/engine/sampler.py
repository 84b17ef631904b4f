"""Next-token sampling for a batch: penalties, logit bias and min_tokens, then temperature,
top-k, top-p, min-p and per-request seeds."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from asyncinfer.attention.host_to_device import upload
from asyncinfer.core import Batch
from asyncinfer.kernels import triton_invariant
from asyncinfer.layers import triton_ops
from asyncinfer.layers.fused import WARM_UP_ROWS, compiled, dynamic_rows
from asyncinfer.params import SamplingParams

_MASK64 = (1 << 64) - 1


def _renormalize(probs: Tensor, keep: Tensor, off: Tensor, scale: bool = True) -> Tensor:
    kept = probs * keep
    if not scale:  # the race draws the same tokens from unscaled weights
        return torch.where(off.unsqueeze(-1), probs, kept)
    renormed = kept / kept.sum(dim=-1, keepdim=True)
    # Rows with the filter off stay bit-identical: no row's filter moves another's draw.
    return torch.where(off.unsqueeze(-1), probs, renormed)


def apply_top_k(probs: Tensor, top_k: Tensor, scale: bool = True) -> Tensor:
    """Keep t iff fewer than k tokens are more probable (ties kept); ``k <= 0``, ``k >= V``: off.
    Without ``scale`` the kept weights are not divided by their sum (as for the filters
    below)."""
    vocab = probs.shape[-1]
    top_k = top_k.to(device=probs.device, dtype=torch.int64)
    off = (top_k <= 0) | (top_k >= vocab)
    descending = probs.sort(dim=-1, descending=True).values
    kth = descending.gather(-1, (top_k.clamp(1, vocab) - 1).unsqueeze(-1))
    return _renormalize(probs, probs >= kth, off, scale)


def apply_top_p(probs: Tensor, top_p: Tensor, scale: bool = True) -> Tensor:
    """Keep t iff the mass of tokens more probable than t is < p; ``p >= 1``: off. Without
    ``scale``, ``probs`` may be weights of any total (mass is then a share of it)."""
    top_p = top_p.to(device=probs.device, dtype=torch.float64)
    off = top_p >= 1.0
    wide = probs.double()  # float64 sums keep the mass within ~1e-15 of the exact one
    ascending = wide.sort(dim=-1).values
    suffix = ascending.flip(-1).cumsum(-1).flip(-1)
    suffix = torch.cat([suffix, torch.zeros_like(suffix[:, :1])], dim=-1)
    first_greater = torch.searchsorted(ascending, wide, right=True)
    greater_mass = suffix.gather(-1, first_greater)
    # Unscaled weights (an earlier filter's): p of their total, the scan's first sum.
    bound = top_p.unsqueeze(-1) if scale else top_p.unsqueeze(-1) * suffix[:, :1]
    return _renormalize(probs, greater_mass < bound, off, scale)


def apply_min_p(probs: Tensor, min_p: Tensor, scale: bool = True) -> Tensor:
    """Keep t iff ``p_t >= min_p * max_u p_u`` (in float64); ``min_p <= 0``: off."""
    min_p = min_p.to(device=probs.device, dtype=torch.float64)
    off = min_p <= 0.0
    wide = probs.double()
    threshold = min_p.unsqueeze(-1) * wide.max(dim=-1, keepdim=True).values
    return _renormalize(probs, wide >= threshold, off, scale)


def device_tensor(values: Sequence[float] | Sequence[int], dtype: torch.dtype,
                  device: torch.device) -> Tensor:
    """A small host list on ``device`` without blocking the host (attention.host_to_device)."""
    return upload(torch.tensor(values, dtype=dtype), device)


def _mix64(x: int) -> int:
    """One splitmix64 step: a bijection on 64-bit integers that spreads every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def request_seed(seed: int, step: int) -> int:
    """The key of a seeded request's ``step``-th token, the same in every process."""
    return _mix64((_mix64(seed & _MASK64) + step) & _MASK64)


_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """Low 32 bits of ``x * c`` (both below 2**32) in int64 without signed overflow."""
    low = x * (c & 0x7FFFFFFF)
    return (low + ((x & 1) << 31) if c >> 31 else low) & _M32


def _hash32(x: Tensor) -> Tensor:
    """A bijective 32-bit integer mixer (xorshift-multiply, "lowbias32" constants)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(keys: Tensor, vocab: int) -> Tensor:
    """Gumbel noise [B, vocab] (float32), a pure function of each row's int64 key: column
    c hashes (c, key) to 23 uniform bits u, noise ``-log(-log u)``, on any device."""
    lo = (keys & _M32).unsqueeze(-1)
    hi = ((keys >> 32) & _M32).unsqueeze(-1)
    cols = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    bits = _hash32(_hash32((cols + lo) & _M32) ^ hi)
    uniform = ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(-torch.log(uniform))


def race(logits: Tensor, inv_temperature: Tensor, keys: Tensor) -> Tensor:
    """One token per row, ``argmax(logits / T + Gumbel)``; ``inv_temperature == 0``: greedy."""
    scaled = logits.float() * inv_temperature.unsqueeze(-1)
    noisy = scaled + gumbel_noise(keys, logits.shape[-1])
    greedy = (inv_temperature == 0).unsqueeze(-1)
    return torch.where(greedy, logits.float(), noisy).argmax(dim=-1)


def race_filtered(probs: Tensor, keys: Tensor,
                  noise: Callable[[Tensor, int], Tensor] = gumbel_noise) -> Tensor:
    """One token per row of filtered probabilities, ``argmax(log p + Gumbel)``."""
    return (probs.log() + noise(keys, probs.shape[-1])).argmax(dim=-1)


def held_back(params: SamplingParams, step: int, eos_token_ids: frozenset[int]) -> list[int]:
    """The ids a row may not sample at ``step`` (its ``step``-th output): before
    ``min_tokens``, EOS (unless ignore_eos) and its stop_token_ids; else none."""
    if step >= params.min_tokens:
        return []
    held = set(params.stop_token_ids)
    if not params.ignore_eos:
        held |= eos_token_ids
    return sorted(held)


def _repeats(p: SamplingParams) -> bool:
    """Whether a row's penalties count its tokens so far."""
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


def penalize(logits: Tensor, history: Tensor, prompt_lens: Tensor, ends: Tensor,
             presence: Tensor, frequency: Tensor, repetition: Tensor) -> Tensor:
    """``logits`` [R, V] (float32) after vLLM's penalties over ``history`` [R, L], each row's
    tokens at positions ``[0, ends)``, its prompt before ``prompt_lens``: ``repetition``
    divides positive and multiplies negative logits of every token seen (prompt or output);
    ``frequency * count + presence * [count > 0]`` is taken off, counting the output only."""
    rows, vocab = logits.shape
    positions = torch.arange(history.shape[1], device=logits.device)
    seen = positions < ends.unsqueeze(-1)
    generated = seen & (positions >= prompt_lens.unsqueeze(-1))
    zeros = torch.zeros(rows, vocab, dtype=torch.float32, device=logits.device)
    counts = zeros.scatter_add(1, history, generated.float())
    anywhere = zeros.scatter_add(1, history, seen.float()) > 0
    factor = torch.where(anywhere, repetition.unsqueeze(-1), 1.0)
    logits = torch.where(logits > 0, logits / factor, logits * factor)
    return (logits - frequency.unsqueeze(-1) * counts
            - presence.unsqueeze(-1) * (counts > 0).float())


class Sampler:
    """Picks one token per row of a logits batch, following each request's SamplingParams.

    Invariant: a seeded request's draw depends on its seed and step alone; an unseeded
    row's key comes from the sampler's ``seed``. See docs/architecture.md, 'Sampling keys'.
    """

    def __init__(self, seed: int = 0, compile: bool = False, backend: str = "inductor",
                 device: torch.device | None = None,
                 argmax: Callable[[Tensor], Tensor] | None = None,
                 invariant: bool = False,
                 race_fn: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
                 noise_fn: Callable[[Tensor, int], Tensor] | None = None) -> None:
        # What ``min_tokens`` holds back besides stop_token_ids: the scheduler's EOS ids.
        self.eos_token_ids: frozenset[int] = frozenset()
        self._keys = np.random.Generator(np.random.PCG64(seed & _MASK64))
        self._argmax = argmax or _argmax
        # ``race_fn``, ``noise_fn``: one-pass versions of ``race`` and ``gumbel_noise`` (the
        # CPU kernels'); else ``race`` runs eagerly, or compiled with ``compile``.
        self._race: Callable[[Tensor, Tensor, Tensor], Tensor] = race_fn or race
        self._noise = noise_fn or gumbel_noise
        self._compiled = False
        # Batch-invariant (on CUDA, where torch's sums over a row may split it by the
        # batch's size): each row's softmax in one fixed order, and the filters' kept
        # weights left unscaled, so that no sum over the row is taken at all.
        self.invariant = invariant
        self.log_softmax: Callable[[Tensor], Tensor] = raw_logprobs
        if invariant:
            self.log_softmax = triton_invariant.log_softmax
        if race_fn is None and compile:
            self._compiled = True
            if device is not None and triton_ops.available(device, "race"):
                self._race = triton_ops.race
            else:
                self._race = compiled(race, backend)

    def sample(
        self, logits: Tensor, params: Sequence[SamplingParams], steps: Sequence[int]
    ) -> Tensor:
        """Int64 token ids [B] for ``logits`` [B, V]; ``steps[i]``: row i's earlier tokens."""
        assert logits.dim() == 2, f"logits must be [B, V], got {tuple(logits.shape)}"
        assert logits.shape[0] == len(params) == len(steps), "one params and step per row"
        device, vocab = logits.device, logits.shape[-1]
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return self._argmax(logits)
        if not any(_filters(p, vocab) for p in params):
            # Greedy rows (temperature below MIN_TEMPERATURE included) race with 0: no 1 / T.
            inv_temperature = [0.0 if p.greedy else 1.0 / p.temperature for p in params]
            return self._race(logits, device_tensor(inv_temperature, torch.float32, device),
                              self._row_keys(params, steps, device))
        chosen = [params[i] for i in rows]
        keys = self._row_keys(chosen, [steps[i] for i in rows], device)
        logits = logits.float()
        if len(rows) == len(params):  # every row samples: no gather, no scatter
            return race_filtered(self._filtered_probs(logits, chosen), keys, self._noise)
        tokens = logits.argmax(dim=-1)
        index = device_tensor(rows, torch.int64, device)
        tokens[index] = race_filtered(self._filtered_probs(logits[index], chosen), keys,
                                      self._noise)
        return tokens

    def adjust(self, logits: Tensor, batch: Batch, token_pool: Tensor) -> Tensor:
        """The logits the batch samples from: a copy where a row asks for ``logit_bias``,
        ``min_tokens`` or penalties (in that order, as vLLM), computed on the device in one
        pass over those rows; ``logits`` itself when none does. The other rows' logits stay
        bit-identical, and ``logits`` (the raw ones) is never written."""
        if not any(p.penalized or p.min_tokens for p in batch.params):
            return logits
        eos = self.eos_token_ids
        rows, held = [], []
        for i, (p, step, sampled) in enumerate(zip(batch.params, batch.steps, batch.sample)):
            ids = held_back(p, step, eos) if sampled and p.min_tokens else []
            if sampled and (p.penalized or ids):
                rows.append(i)
                held.append(ids)
        if not rows:
            return logits
        device, vocab = logits.device, logits.shape[-1]
        params = [batch.params[i] for i in rows]
        index = device_tensor(rows, torch.int64, device)
        chosen = logits[index].float()
        # Bias (added up) and held-back ids (-inf after it) as (row, id) pairs: one upload each.
        biased = [(j, t, b) for j, p in enumerate(params) for t, b in p.logit_bias]
        masked = [(j, t) for j, ids in enumerate(held) for t in ids if t < vocab]
        assert all(t < vocab for _, t, _ in biased), "logit_bias ids are checked at submit"
        if biased:
            at = device_tensor([x for j, t, _ in biased for x in (j, t)], torch.int64,
                               device).view(-1, 2)
            chosen.index_put_((at[:, 0], at[:, 1]),
                              device_tensor([b for *_, b in biased], torch.float32, device),
                              accumulate=True)
        if masked:
            at = device_tensor([x for pair in masked for x in pair], torch.int64,
                               device).view(-1, 2)
            chosen[at[:, 0], at[:, 1]] = float("-inf")
        counted = [j for j, p in enumerate(params) if _repeats(p)]
        if counted:
            which = [rows[j] for j in counted]
            ints = device_tensor([batch.rows[i] for i in which] + [batch.prompt_lens[i]
                                 for i in which] + [batch.ends[i] for i in which],
                                 torch.int64, device).view(3, -1)
            floats = device_tensor(
                [params[j].presence_penalty for j in counted]
                + [params[j].frequency_penalty for j in counted]
                + [params[j].repetition_penalty for j in counted],
                torch.float32, device).view(3, -1)
            history = token_pool[ints[0].unsqueeze(-1),
                                 torch.arange(max(batch.ends[i] for i in which), device=device)]
            if len(counted) == len(rows):
                chosen = penalize(chosen, history, ints[1], ints[2], *floats)
            else:
                at = device_tensor(counted, torch.int64, device)
                chosen[at] = penalize(chosen[at], history, ints[1], ints[2], *floats)
        adjusted = logits.clone()
        adjusted[index] = chosen.to(adjusted.dtype)
        return adjusted

    @torch.inference_mode()
    def warm_up(self, vocab: int, dtype: torch.dtype, device: torch.device) -> None:
        """Compile the fused pass for any batch size (dynamic) and for 1, before serving."""
        if not self._compiled:
            return
        for rows in WARM_UP_ROWS:
            self._race(*dynamic_rows(torch.zeros(rows, vocab, dtype=dtype, device=device),
                                     torch.ones(rows, device=device),
                                     torch.zeros(rows, dtype=torch.int64, device=device)))

    def _row_keys(self, params: Sequence[SamplingParams], steps: Sequence[int],
                  device: torch.device) -> Tensor:
        """Each row's noise key: from its seed and step if seeded, else a fresh draw."""
        keys = self._keys.integers(-(2**63), 2**63, size=len(params), dtype=np.int64)
        for i, (p, step) in enumerate(zip(params, steps, strict=True)):
            if p.seed is not None:
                key = request_seed(p.seed, step)
                keys[i] = key - (1 << 64) if key >= 1 << 63 else key
        return upload(torch.from_numpy(keys), device)

    def _filtered_probs(self, logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
        """Probabilities after temperature and filters (``params``: sampled rows only)."""
        device, vocab = logits.device, logits.shape[-1]
        temperature = device_tensor([p.temperature for p in params], torch.float32, device)
        if self.invariant:
            probs = triton_invariant.softmax(logits, 1.0 / temperature)
        else:
            probs = torch.softmax(logits / temperature.unsqueeze(-1), dim=-1)
        scale = not self.invariant
        if any(0 < p.top_k < vocab for p in params):
            # A top_k beyond the vocabulary means off: clamped, it also fits any int tensor.
            top_k = [min(p.top_k, vocab) for p in params]
            probs = apply_top_k(probs, device_tensor(top_k, torch.int64, device), scale)
        if any(p.top_p < 1.0 for p in params):
            top_p = device_tensor([p.top_p for p in params], torch.float64, device)
            probs = apply_top_p(probs, top_p, scale)
        if any(p.min_p > 0.0 for p in params):
            min_p = device_tensor([p.min_p for p in params], torch.float64, device)
            probs = apply_min_p(probs, min_p, scale)
        return probs


def raw_logprobs(logits: Tensor) -> Tensor:
    """The model's raw distribution, as log-probabilities in float32: the log-softmax of the
    logits before penalties, bias, temperature and filters."""
    return torch.log_softmax(logits.float(), dim=-1)


def top_logprobs(logprobs: Tensor, targets: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Of ``logprobs`` [R, V]: each row's ``targets`` token's, then its ``k`` most probable
    ones'; returns the values [R, 1 + k] and the ids of the top ``k`` [R, k], most probable
    first."""
    chosen = logprobs.gather(-1, targets.unsqueeze(-1))
    if k == 0:
        return chosen, targets.new_empty(len(targets), 0)
    top = logprobs.topk(k, dim=-1)
    return torch.cat([chosen, top.values], dim=-1), top.indices


def _argmax(logits: Tensor) -> Tensor:
    return logits.float().argmax(dim=-1)


def _filters(p: SamplingParams, vocab: int) -> bool:
    """Whether a sampled row needs its probabilities filtered (top-k, top-p or min-p)."""
    return not p.greedy and (0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0)
