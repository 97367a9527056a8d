"""The usage record of one request, as the gateway produces it (before it reaches SQL).

A record says what was *delivered* (prompt and cached tokens by tier, completion tokens actually sent),
who ended the request (``outcome``) and what it cost, priced when the request ran: the unit prices are
frozen into the record, so changing or deleting a tenant later never re-prices its history.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

TIERS = ("l1", "l2", "l3", "remote")

# Who ended a request. Only these values are stored (a CHECK-free string column: keep them short).
OUTCOME_COMPLETED = "completed"  # the answer was delivered whole
OUTCOME_CLIENT_CANCELLED = "client_cancelled"  # the client went away; billed what was sent
OUTCOME_CLIENT_ERROR = "client_error"  # refused before any work (4xx): costs nothing
OUTCOME_SERVER_ERROR = "server_error"  # a worker failed or crashed; billed what was sent
OUTCOME_SHUTDOWN = "shutdown"  # the gateway stopped while it ran; billed what was sent
# Delivered by an external upstream that reported no token counts: the tokens are unknown, billed 0.
OUTCOME_USAGE_UNREPORTED = "usage_unreported"
# The client went away from an external upstream's stream before it reported usage: the tokens billed
# are the gateway's estimate (prompt: tokenizer or characters / 4; completion: chunks relayed).
OUTCOME_CANCELLED_ESTIMATED = "cancelled_estimated"
# The worker answered but the gateway could not format the answer (500, or an error event in a stream):
# the tokens the worker used are recorded; what was delivered is billed, so a 500 costs nothing.
OUTCOME_FORMAT_ERROR = "format_error"
OUTCOMES = (
    OUTCOME_COMPLETED,
    OUTCOME_CLIENT_CANCELLED,
    OUTCOME_CLIENT_ERROR,
    OUTCOME_SERVER_ERROR,
    OUTCOME_SHUTDOWN,
    OUTCOME_USAGE_UNREPORTED,
    OUTCOME_CANCELLED_ESTIMATED,
    OUTCOME_FORMAT_ERROR,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Prices:
    """Prices per million tokens."""

    input_per_mtok: float
    cached_input_per_mtok: float
    output_per_mtok: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Cost:
    """What one record costs, in the price's currency (rounded to 1e-9)."""

    uncached_input: float
    cached_input: float
    output: float

    @property
    def total(self) -> float:
        return round(self.uncached_input + self.cached_input + self.output, 9)


def price_tokens(prices: Prices, *, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> Cost:
    """Cost of delivered tokens: uncached prompt at the input price, cached prompt at the cached
    price, completion at the output price."""
    uncached = max(prompt_tokens - cached_tokens, 0)
    return Cost(
        uncached_input=round(uncached * prices.input_per_mtok / 1e6, 9),
        cached_input=round(min(cached_tokens, prompt_tokens) * prices.cached_input_per_mtok / 1e6, 9),
        output=round(completion_tokens * prices.output_per_mtok / 1e6, 9),
    )


ZERO_PRICES = Prices(input_per_mtok=0.0, cached_input_per_mtok=0.0, output_per_mtok=0.0)


_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")  # NUL (PostgreSQL text refuses it), lone surrogates


def storable_text(value: str, limit: int) -> str:
    """``value`` cut to ``limit`` characters with what no database text column accepts replaced by
    U+FFFD: a client-chosen string (model, user, request id) must never make a record unstorable."""
    value = value[:limit]
    return _UNSTORABLE.sub("\ufffd", value) if _UNSTORABLE.search(value) else value


@dataclass(frozen=True, kw_only=True, slots=True)
class UsageEvent:
    request_id: str  # unique; the idempotency key of spool replay
    tenant_id: str
    model: str
    endpoint: str  # "chat.completions" | "completions"
    status: int  # HTTP status returned to the tenant (a stream cut later keeps its 200)
    outcome: str = OUTCOME_COMPLETED  # who ended it: one of OUTCOMES
    tenant_name: str = ""  # the name when the request ran (the tenant may be renamed or deleted)
    key_id: str | None = None  # the API key it authenticated with
    end_user: str | None = None  # the request's `user` field
    prompt_tokens: int = 0  # billed prompt tokens (0 when nothing was delivered, unless not billable)
    cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    completion_tokens: int = 0  # tokens actually sent to the client
    prefill_ms: float = 0.0
    saved_prefill_ms: float = 0.0
    prices: Prices = ZERO_PRICES  # unit prices in force when the request ran
    # False: the tokens above were used but nothing was delivered (format_error); the record costs nothing.
    billable: bool = True
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))

    @property
    def cost(self) -> Cost:
        return price_tokens(
            self.prices if self.billable else ZERO_PRICES,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens,
        )

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["created_at"] = self.created_at.isoformat()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> UsageEvent:
        values = dict(data)
        values["created_at"] = datetime.fromisoformat(values["created_at"])
        if isinstance(values.get("prices"), dict):
            values["prices"] = Prices(**values["prices"])
        return cls(**values)

    def to_row(self) -> dict[str, Any]:
        """Column values of ``tenancy.models.UsageRecord``."""
        created_at = self.created_at if self.created_at.tzinfo else self.created_at.replace(tzinfo=UTC)
        by_tier = self.cached_tokens_by_tier
        cost = self.cost
        return {
            "request_id": storable_text(self.request_id, 80),
            "tenant_id": storable_text(self.tenant_id, 40),
            "tenant_name": storable_text(self.tenant_name, 200),
            "key_id": None if self.key_id is None else storable_text(self.key_id, 40),
            "end_user": None if self.end_user is None else storable_text(self.end_user, 200),
            "model": storable_text(self.model, 200),
            "endpoint": storable_text(self.endpoint, 40),
            "status": self.status,
            "outcome": storable_text(self.outcome, 20),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_l1_tokens": int(by_tier.get("l1", 0)),
            "cached_l2_tokens": int(by_tier.get("l2", 0)),
            "cached_l3_tokens": int(by_tier.get("l3", 0)),
            "cached_remote_tokens": int(by_tier.get("remote", 0)),
            "completion_tokens": self.completion_tokens,
            "prefill_ms": float(self.prefill_ms),
            "saved_prefill_ms": float(self.saved_prefill_ms),
            "price_input_per_mtok": self.prices.input_per_mtok,
            "price_cached_input_per_mtok": self.prices.cached_input_per_mtok,
            "price_output_per_mtok": self.prices.output_per_mtok,
            "cost_uncached_input": cost.uncached_input,
            "cost_cached_input": cost.cached_input,
            "cost_output": cost.output,
            "cost_total": cost.total,
            "billable": self.billable,
            "created_at": created_at,
            "created_hour": int(created_at.timestamp() // 3600),
        }
