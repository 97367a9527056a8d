"""Admission control of one gateway replica: bounds on requests in flight, answered at once.

Two bounds, checked before any work is done for a request:

- all tenants together (``max_in_flight``, the gateway's config): over it, 503 with ``Retry-After``
  (the gateway is saturated, not the tenant's fault);
- per tenant (``max_concurrent_requests``, a tenant policy field): over it, 429 with ``Retry-After``;
- one tenant's share of ``max_in_flight`` (``tenant_share``, 0.5 by default): a tenant without a
  ``max_concurrent_requests`` of its own could otherwise hold every slot (e.g. with streams an upstream
  never ends) and every other tenant would get 503. Past its share a tenant gets 429, like its own limit.

Nothing waits in a queue here: excess load is refused fast so that a client backs off instead of
piling up behind requests that would time out anyway. The rate limits per minute are
``gateway.ratelimit``'s.

A request with ``n`` choices is ``n`` worker generations, so it counts as ``n`` requests against the
tenant's concurrency and requests-per-minute limits (OpenAI and LiteLLM count it as one request; here one
tenant could otherwise use ``n`` to run ``n`` times its concurrency on the shared workers). It enters as
one request before its body is read (a tenant over its limits costs no parsing); ``admit_choices`` counts
the other ``n - 1`` once ``n`` is known, or refuses the request and gives back what it counted. The
replica-wide ``max_in_flight`` counts requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.errors import RateLimited, Unavailable
from gateway.ratelimit import Counted, RateLimiter, requests_key
from tenancy.policy import TenantPolicy


@dataclass(slots=True)
class AdmissionGate:
    max_in_flight: int  # all tenants together on this replica; 0: unbounded
    tenant_share: float = 1.0  # of max_in_flight one tenant may hold
    in_flight: int = 0  # requests
    tenant_to_in_flight: dict[str, int] = field(default_factory=dict)  # slots: a request holds one per choice
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
        tenant_limit = self.tenant_limit(tenant_limit)
        if tenant_limit and mine >= tenant_limit:
            self.num_refused += 1
            raise RateLimited(
                f"limit of {tenant_limit} concurrent requests reached; retry when one finishes",
                code="concurrency_limit_exceeded",
            )
        self.in_flight += 1
        self.tenant_to_in_flight[tenant_id] = mine + 1

    def widen(self, tenant_id: str, extra_slots: int, tenant_limit: int | None, *, num_choices: int) -> None:
        """Count ``extra_slots`` more for a request already in (its choices beyond the first), or raise
        ``RateLimited`` and count nothing more."""
        mine = self.tenant_to_in_flight.get(tenant_id, 0)  # this request's first slot included
        tenant_limit = self.tenant_limit(tenant_limit)
        if tenant_limit and mine + extra_slots > tenant_limit:
            self.num_refused += 1
            raise RateLimited(
                f"limit of {tenant_limit} concurrent requests reached: n={num_choices} choices count as "
                f"{num_choices} requests and {mine - 1} are in flight; retry when some finish",
                code="concurrency_limit_exceeded",
            )
        self.tenant_to_in_flight[tenant_id] = mine + extra_slots

    def tenant_limit(self, own_limit: int | None) -> int | None:
        """The tenant's concurrency limit on this replica: its own, capped by its share of the gateway's."""
        if not self.max_in_flight or self.tenant_share >= 1.0:
            return own_limit
        share = max(1, int(self.max_in_flight * self.tenant_share))
        return share if not own_limit else min(own_limit, share)

    def leave(self, tenant_id: str, slots: int = 1) -> None:
        """Count a request out (exactly once per successful ``enter``, with every slot it holds)."""
        self.in_flight -= 1
        left = self.tenant_to_in_flight.get(tenant_id, slots) - slots
        if left > 0:
            self.tenant_to_in_flight[tenant_id] = left
        else:
            self.tenant_to_in_flight.pop(tenant_id, None)


async def admit_choices(
    gate: AdmissionGate,
    limiter: RateLimiter,
    tenant: TenantPolicy,
    num_choices: int,
    rate_headers: dict,
    first_counted: Counted | None,
) -> int:
    """Count a request's ``num_choices - 1`` choices beyond the first against the tenant's requests per
    minute and concurrent requests; returns the admission slots it holds from now on (``num_choices``).

    Raises ``RateLimited`` (429) when they do not fit (``n_exceeds_limit`` when ``n`` alone is over a
    limit: it never will) after giving back the request's first unit of requests per minute (counted at
    ``first_counted``), so that a refused request counts nothing; it then still holds its one slot.
    ``rate_headers`` (the request's ``x-ratelimit-*``) are updated.
    """
    extra = num_choices - 1
    if extra == 0:
        return 1
    rpm_key, rpm = requests_key(tenant.tenant_id), tenant.rate_limit_rpm

    async def refuse(error: RateLimited, extra_counted: Counted | None = None) -> RateLimited:
        if rpm:
            await limiter.refund(rpm_key, 1, first_counted)
            await limiter.refund(rpm_key, extra, extra_counted)
        error.headers = {**rate_headers, **error.headers}
        return error

    for limit, what in (
        (rpm, "requests per minute"),
        (gate.tenant_limit(tenant.max_concurrent_requests), "concurrent requests"),
    ):
        if limit and num_choices > limit:
            message = (
                f"n={num_choices} choices count as {num_choices} requests and the limit of {limit} {what} "
                "can never fit them; lower n"
            )
            raise await refuse(RateLimited(message, param="n", code="n_exceeds_limit"))
    decision = await limiter.check(rpm_key, rpm, extra)
    rate_headers.update(decision.headers("requests"))
    if not decision.allowed:
        message = f"rate limit of {rpm} requests per minute reached: n={num_choices} choices count as "
        error = RateLimited(f"{message}{num_choices} requests", retry_after_s=decision.retry_after_s)
        raise await refuse(error)
    try:
        gate.widen(tenant.tenant_id, extra, tenant.max_concurrent_requests, num_choices=num_choices)
    except RateLimited as error:
        raise await refuse(error, decision.counted) from None
    return num_choices
