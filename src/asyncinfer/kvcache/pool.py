"""The KV page pool and the allocator that hands out its pages."""

from __future__ import annotations

import torch

from asyncinfer.memory import zeros_huge

# FP8 formats a pool may store (kv_cache_dtype), each with its largest finite value.
FP8_DTYPES = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

# The share of the memory available at start-up that the CPU pool may take by default.
CPU_MEMORY_SHARE = 0.125


def cpu_kv_budget(bytes_per_token: int, context_len: int, max_running_requests: int,
                  available: int | None) -> int:
    """Bytes of a CPU KV pool left unsized: room for ``max_running_requests`` sequences of
    ``context_len`` tokens, at most CPU_MEMORY_SHARE of ``available`` bytes (unknown: 2 GiB),
    but room for one whole sequence where half of ``available`` holds it."""
    wanted = bytes_per_token * context_len * max_running_requests
    if available is None:
        return min(wanted, 2 * 2**30)
    one = min(bytes_per_token * context_len, available // 2)
    return min(wanted, max(int(CPU_MEMORY_SHARE * available), one))


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a pool of ``dtype`` stores FP8 (read back in the model's dtype)."""
    return dtype in FP8_DTYPES


def narrow(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the pool's ``dtype``; into FP8 saturated at the format's largest finite
    value (unscaled: no calibrated scales are loaded, as in vLLM's and SGLang's default)."""
    limit = FP8_DTYPES.get(dtype)
    if limit is None:
        return x.to(dtype)
    return x.float().clamp(-limit, limit).to(dtype)


class KVPool:
    """K and V of every layer; a token's slot is ``page * page_size + offset``. An FP8 pool
    holds them unscaled, saturated at the format's range (see ``narrow``)."""

    def __init__(
        self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
        head_dim: int, dtype: torch.dtype, device: torch.device,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        if device.type == "cpu":  # huge pages, and memory committed only as pages fill
            self.k = zeros_huge(shape, dtype)
            self.v = zeros_huge(shape, dtype)
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Write new tokens' K and V into their slots of one layer's caches (the fused path is
    layers.fused.qk_norm_rope_store)."""
    k_cache[slots] = narrow(k, k_cache.dtype)
    v_cache[slots] = narrow(v, v_cache.dtype)


class PageAllocator:
    """Free list of page ids; lowest ids first so allocation order is the same on every rank."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages; the caller checked that they are free."""
        assert n <= len(self._free), f"asked for {n} pages, {len(self._free)} free"
        if n == 0:
            return []
        pages = self._free[-n:][::-1]
        del self._free[-n:]
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(sorted(pages, reverse=True))
        self._free.sort(reverse=True)
        assert len(self._free) <= self.num_pages, "a page was freed twice"
