"""Admission control of one gateway replica: bounds on requests in flight, answered at once.

Two bounds, checked before any work is done for a request:

- all tenants together (``max_in_flight``, the gateway's config): over it, 503 with ``Retry-After``
  (the gateway is saturated, not the tenant's fault);
- per tenant (``max_concurrent_requests``, a tenant policy field): over it, 429 with ``Retry-After``.

Nothing waits in a queue here: excess load is refused fast so that a client backs off instead of
piling up behind requests that would time out anyway. The rate limits per minute are
``gateway.ratelimit``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.errors import RateLimited, Unavailable


@dataclass(slots=True)
class AdmissionGate:
    max_in_flight: int  # all tenants together on this replica; 0: unbounded
    in_flight: int = 0
    tenant_to_in_flight: dict[str, int] = field(default_factory=dict)
    num_refused: int = 0

    def enter(self, tenant_id: str, tenant_limit: int | None) -> None:
        """Count a request in, or raise ``Unavailable`` (gateway full) / ``RateLimited`` (tenant)."""
        if self.max_in_flight and self.in_flight >= self.max_in_flight:
            self.num_refused += 1
            raise Unavailable(
                f"the gateway is at its limit of {self.max_in_flight} requests in flight; retry shortly",
                code="server_overloaded",
            )
        mine = self.tenant_to_in_flight.get(tenant_id, 0)
        if tenant_limit and mine >= tenant_limit:
            self.num_refused += 1
            raise RateLimited(
                f"limit of {tenant_limit} concurrent requests reached; retry when one finishes",
                code="concurrency_limit_exceeded",
            )
        self.in_flight += 1
        self.tenant_to_in_flight[tenant_id] = mine + 1

    def leave(self, tenant_id: str) -> None:
        """Count a request out (exactly once per successful ``enter``)."""
        self.in_flight -= 1
        left = self.tenant_to_in_flight.get(tenant_id, 1) - 1
        if left:
            self.tenant_to_in_flight[tenant_id] = left
        else:
            self.tenant_to_in_flight.pop(tenant_id, None)
