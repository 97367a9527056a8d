"""The usage record of one request, as the gateway produces it (before it reaches SQL)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

TIERS = ("l1", "l2", "l3", "remote")


@dataclass(frozen=True, kw_only=True, slots=True)
class UsageEvent:
    request_id: str  # unique; the idempotency key of spool replay
    tenant_id: str
    model: str
    endpoint: str  # "chat.completions" | "completions"
    status: int  # HTTP status returned to the tenant
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    completion_tokens: int = 0
    prefill_ms: float = 0.0
    saved_prefill_ms: float = 0.0
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["created_at"] = self.created_at.isoformat()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> UsageEvent:
        values = dict(data)
        values["created_at"] = datetime.fromisoformat(values["created_at"])
        return cls(**values)

    def to_row(self) -> dict[str, Any]:
        """Column values of ``tenancy.models.UsageRecord``."""
        created_at = self.created_at if self.created_at.tzinfo else self.created_at.replace(tzinfo=UTC)
        by_tier = self.cached_tokens_by_tier
        return {
            "request_id": self.request_id,
            "tenant_id": self.tenant_id,
            "model": self.model[:200],  # a client-chosen string: must never make a record unstorable
            "endpoint": self.endpoint,
            "status": self.status,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_l1_tokens": int(by_tier.get("l1", 0)),
            "cached_l2_tokens": int(by_tier.get("l2", 0)),
            "cached_l3_tokens": int(by_tier.get("l3", 0)),
            "cached_remote_tokens": int(by_tier.get("remote", 0)),
            "completion_tokens": self.completion_tokens,
            "prefill_ms": float(self.prefill_ms),
            "saved_prefill_ms": float(self.saved_prefill_ms),
            "created_at": created_at,
            "created_hour": int(created_at.timestamp() // 3600),
        }
