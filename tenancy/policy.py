"""Tenant policy: the frozen snapshot the hot path reads, and validation of admin-supplied fields."""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from policies.canonicalize import MODES, NOTE_ROLES, CanonicalizationPolicy
from policies.isolation import DEFAULT_ISOLATION, ISOLATION_LEVELS
from tenancy.models import Tenant

CANONICALIZATION_MODES = tuple(MODES)


@dataclass(frozen=True, kw_only=True, slots=True)
class TenantPolicy:
    """Everything a request of one tenant needs, read without SQL."""

    tenant_id: str
    name: str
    isolation: str = DEFAULT_ISOLATION  # a key of policies.isolation.ISOLATION_LEVELS
    reserved_blocks: int = 0  # dedicated quota, forwarded as the segment's reserved_blocks
    canonicalization: str = "report"  # on|report|off (policies.canonicalize.MODES)
    # Extra fragment patterns as (name, regex) pairs, in the order the admin gave them.
    canonicalization_patterns: tuple[tuple[str, str], ...] = ()
    canonicalization_disabled_rules: tuple[str, ...] = ()  # built-in rules turned off
    canonicalization_note_role: str = "user"  # role of the trailing note of moved values
    share_hot_prefixes: bool = False  # opt-in to promoted global prefixes (and to feed their counters)
    near_miss_routing: bool = False  # opt-in to the FAISS near-miss route fallback (gateway.near_miss)
    epoch: int = 0
    price_input_per_mtok: float | None = None
    price_cached_input_per_mtok: float | None = None
    price_output_per_mtok: float | None = None
    max_tokens_limit: int | None = None
    rate_limit_rpm: int | None = None
    rate_limit_tpm: int | None = None  # prompt tokens + max_tokens per minute
    max_concurrent_requests: int | None = None  # in flight at once, per gateway replica

    @classmethod
    def from_row(cls, tenant: Tenant) -> TenantPolicy:
        return cls(
            tenant_id=tenant.id,
            name=tenant.name,
            isolation=tenant.isolation,
            reserved_blocks=tenant.reserved_blocks,
            canonicalization=tenant.canonicalization,
            canonicalization_patterns=tuple((tenant.canonicalization_patterns or {}).items()),
            canonicalization_disabled_rules=tuple(tenant.canonicalization_disabled_rules or ()),
            canonicalization_note_role=tenant.canonicalization_note_role,
            share_hot_prefixes=tenant.share_hot_prefixes,
            near_miss_routing=tenant.near_miss_routing,
            epoch=tenant.epoch,
            price_input_per_mtok=tenant.price_input_per_mtok,
            price_cached_input_per_mtok=tenant.price_cached_input_per_mtok,
            price_output_per_mtok=tenant.price_output_per_mtok,
            max_tokens_limit=tenant.max_tokens_limit,
            rate_limit_rpm=tenant.rate_limit_rpm,
            rate_limit_tpm=tenant.rate_limit_tpm,
            max_concurrent_requests=tenant.max_concurrent_requests,
        )


# Fields an admin may set at creation or with PATCH (name included), with their checks.
POLICY_FIELDS = tuple(f.name for f in fields(TenantPolicy) if f.name not in {"tenant_id", "epoch"})
_NULLABLE = {
    "price_input_per_mtok",
    "price_cached_input_per_mtok",
    "price_output_per_mtok",
    "max_tokens_limit",
    "rate_limit_rpm",
    "rate_limit_tpm",
    "max_concurrent_requests",
}


MAX_SQL_INT = 2**31 - 1
MAX_PRICE = 1e9  # per million tokens; bounds the float conversion of huge JSON integers


class PolicyError(ValueError):
    """An admin supplied an unknown field or a value of the wrong type or range."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _check(name: str, value: Any) -> Any:
    if value is None:
        if name in _NULLABLE:
            return None
        raise PolicyError(f"'{name}' may not be null", name)
    if name == "name":
        if not isinstance(value, str) or not value.strip() or len(value) > 200:
            raise PolicyError("'name' must be a non-empty string of at most 200 characters", name)
        if any(unicodedata.category(char) == "Cc" for char in value):  # escapes reach CLIs, logs, reports
            raise PolicyError("'name' may not contain control characters", name)
        return value.strip()
    if name == "isolation":
        if not isinstance(value, str) or value not in ISOLATION_LEVELS:
            raise PolicyError(f"'isolation' must be one of {sorted(ISOLATION_LEVELS)}", name)
        return value
    if name == "canonicalization":
        if not isinstance(value, str) or value not in CANONICALIZATION_MODES:
            raise PolicyError(f"'canonicalization' must be one of {list(CANONICALIZATION_MODES)}", name)
        return value
    if name.startswith("canonicalization_"):
        return _check_canonicalization(name, value)
    if name in {"share_hot_prefixes", "near_miss_routing"}:
        if not isinstance(value, bool):
            raise PolicyError(f"'{name}' must be a boolean", name)
        return value
    if name.startswith("price_"):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_PRICE:
            raise PolicyError(f"'{name}' must be a number between 0 and {MAX_PRICE:g}", name)
        return float(value)
    # reserved_blocks, max_tokens_limit, rate_limit_rpm, rate_limit_tpm, max_concurrent_requests:
    # stored as SQL INTEGER (signed 32 bits)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SQL_INT:
        raise PolicyError(f"'{name}' must be an integer between 0 and {MAX_SQL_INT}", name)
    return value


def _check_canonicalization(name: str, value: Any) -> Any:
    """Tenant canonicalization settings, checked by the same code that compiles them per request
    (patterns are judged for catastrophic backtracking before they are ever run)."""
    try:
        if name == "canonicalization_patterns":
            if not isinstance(value, dict):
                raise ValueError(
                    "'canonicalization_patterns' must be an object of name -> regular expression"
                )
            CanonicalizationPolicy.from_tenant(patterns=value)
            return dict(value)
        if name == "canonicalization_disabled_rules":
            if not isinstance(value, list) or not all(isinstance(rule, str) for rule in value):
                raise ValueError("'canonicalization_disabled_rules' must be a list of rule names")
            CanonicalizationPolicy.from_tenant(disabled_rules=value)
            return sorted(set(value))
        if value not in NOTE_ROLES:
            raise ValueError(f"'canonicalization_note_role' must be one of {list(NOTE_ROLES)}")
        return value
    except ValueError as exc:
        raise PolicyError(str(exc), name) from None


def canonicalization_policy(policy: TenantPolicy) -> CanonicalizationPolicy:
    """The tenant's compiled canonicalization policy (validated when stored; cache the result)."""
    return CanonicalizationPolicy.from_tenant(
        mode=policy.canonicalization,
        patterns=dict(policy.canonicalization_patterns),
        disabled_rules=policy.canonicalization_disabled_rules,
        note_role=policy.canonicalization_note_role,
    )


def validate_policy_fields(body: Mapping[str, Any], *, require_name: bool) -> dict[str, Any]:
    """Checked copy of the policy fields in ``body``; raises PolicyError on the first bad one."""
    unknown = sorted(set(body) - set(POLICY_FIELDS))
    if unknown:
        raise PolicyError(f"unknown field(s): {', '.join(unknown)}", unknown[0])
    if require_name and "name" not in body:
        raise PolicyError("'name' is required", "name")
    return {name: _check(name, value) for name, value in body.items()}
