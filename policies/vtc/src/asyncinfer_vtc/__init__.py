"""Per-tenant fair share: the Virtual Token Counter (Sheng et al., OSDI'24) as a policy."""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from typing import Any, ClassVar

from attrs import Attribute, define, field

from asyncinfer.errors import ConfigError
from asyncinfer.policies import Decision, SchedulerView, WaitingRequest

__all__ = ["VTC", "service_bound"]


def _weight(policy: Any, attribute: Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise ConfigError(f"{policy.name}: option {attribute.name} must be a finite number "
                          f"> 0, got {value!r}")


def _positive_int(policy: Any, attribute: Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{policy.name}: option {attribute.name} must be an integer >= 1, "
                          f"got {value!r}")


def service_bound(w_in: float, w_out: float, max_input_len: int, kv_tokens: int) -> float:
    """The service gap bound of two tenants backlogged together (``M``: the KV tokens)."""
    return 2 * max(w_in * max_input_len, w_out * kv_tokens)


@define
class VTC:
    """Serve tenants in turn by the service they got: the lowest virtual counter goes next.

    Counters, kept across views, grow by ``w_in`` per prompt and ``w_out`` per output token
    served; a tenant that starts waiting is lifted to the lowest one waiting. See the README."""

    name: ClassVar[str] = "vtc"
    options: ClassVar[dict[str, str]] = {
        "w_in": "cost of one input (prompt) token (> 0)",
        "w_out": "cost of one output token (> 0)",
        "max_tenants": "counters kept for tenants with no request (>= 1)",
    }

    w_in: float = field(default=1.0, validator=_weight)
    w_out: float = field(default=2.0, validator=_weight)
    max_tenants: int = field(default=65536, validator=_positive_int)
    _counters: dict[str, float] = field(factory=dict, init=False, repr=False)
    _waiting: frozenset[str] = field(default=frozenset(), init=False, repr=False)
    _floor: float = field(default=0.0, init=False, repr=False)

    def counter(self, tenant: str) -> float:
        """The tenant's virtual counter (0 for one never seen or forgotten)."""
        return self._counters.get(tenant, 0.0)

    def decide(self, view: SchedulerView) -> Decision:
        """Account what was served, lift tenants that start waiting, then prefill by counter."""
        counters = self._counters
        for s in view.served:
            cost = self.w_in * s.input_tokens + self.w_out * s.output_tokens
            counters[s.tenant] = counters.pop(s.tenant, 0.0) + cost
        waiting = view.waiting.tenants()
        arrived = waiting - self._waiting
        if arrived:
            stayed = waiting & self._waiting
            floor = min(counters.get(t, 0.0) for t in stayed) if stayed else self._floor
            for tenant in sorted(arrived):
                counters[tenant] = max(counters.pop(tenant, 0.0), floor)
        if waiting:
            self._floor = min(counters[t] for t in waiting)
        self._waiting = waiting
        if len(counters) > self.max_tenants:
            self._forget(view)
        if not view.waiting:
            return Decision.decode()
        return Decision.prefill(self._order(view), "stop")

    def _order(self, view: SchedulerView) -> list[int]:
        """Repeated picks of the lowest counter, each charged its prompt, while rows last:
        reads one tenant's queue head per pick, so O(tenants + rows), whatever the queue.
        Half-prefilled requests are passed over: they resume first, already charged."""
        waiting = view.waiting
        queues: dict[str, Iterator[WaitingRequest]] = {
            t: (r for r in waiting.of_tenant(t) if not r.chunked) for t in sorted(self._waiting)}
        heads = {t: next(q, None) for t, q in queues.items()}
        heap = [(self._counters[t], waiting.place(req.uid), t)
                for t, req in heads.items() if req is not None]
        heapq.heapify(heap)
        order: list[int] = []
        while heap and len(order) < view.free_slots + 1:
            value, _, tenant = heapq.heappop(heap)
            req = heads[tenant]
            assert req is not None
            order.append(req.uid)
            if req.preemptions == 0:  # charged when first admitted
                value += self.w_in * req.prompt_len
            following = heads[tenant] = next(queues[tenant], None)
            if following is not None:
                heapq.heappush(heap, (value, waiting.place(following.uid), tenant))
        return order

    def _forget(self, view: SchedulerView) -> None:
        """Drop the least recently served counters of tenants with no request."""
        active = self._waiting | {r.tenant for r in view.running}
        excess = len(self._counters) - self.max_tenants
        for tenant in [t for t in self._counters if t not in active][:excess]:
            del self._counters[tenant]
