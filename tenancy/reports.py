"""Per-tenant usage and hit-rate reports, aggregated in SQL by hour or day, priced per tenant."""

from __future__ import annotations

import csv
import io
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

from sqlalchemy import case, func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenancy.models import Tenant, UsageRecord

GRANULARITY_HOURS = {"hour": 1, "day": 24}


@dataclass(frozen=True, kw_only=True, slots=True)
class Prices:
    """Prices per million tokens."""

    input_per_mtok: float
    cached_input_per_mtok: float
    output_per_mtok: float


@dataclass(frozen=True, kw_only=True, slots=True)
class ReportRow:
    tenant_id: str
    tenant_name: str | None  # None when the tenant was deleted since
    period_start: str  # ISO 8601, UTC
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    uncached_prompt_tokens: int
    completion_tokens: int
    hit_rate: float  # cached / prompt tokens
    cached_l1_tokens: int
    cached_l2_tokens: int
    cached_l3_tokens: int
    cached_remote_tokens: int
    prefill_s: float
    saved_prefill_s: float
    cost_uncached_input: float
    cost_cached_input: float
    cost_output: float
    cost_total: float
    saved_cost: float  # what the cached tokens would have cost at the uncached input price


def _hour(moment: datetime) -> int:
    moment = moment if moment.tzinfo else moment.replace(tzinfo=UTC)
    return int(moment.timestamp() // 3600)


async def usage_report(
    sessionmaker: async_sessionmaker[AsyncSession],
    *,
    default_prices: Prices,
    tenant_id: str | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
    granularity: str = "day",
) -> list[ReportRow]:
    """Rows per (tenant, period), oldest first. ``start`` is inclusive and ``end`` exclusive, both
    rounded down to the hour."""
    step = GRANULARITY_HOURS[granularity]
    bucket = (UsageRecord.created_hour - UsageRecord.created_hour % step).label("bucket")
    columns = [
        func.count().label("requests"),
        func.sum(case((UsageRecord.status >= 400, 1), else_=0)).label("errors"),
        *(
            func.coalesce(func.sum(getattr(UsageRecord, name)), 0).label(name)
            for name in (
                "prompt_tokens",
                "cached_tokens",
                "completion_tokens",
                "cached_l1_tokens",
                "cached_l2_tokens",
                "cached_l3_tokens",
                "cached_remote_tokens",
                "prefill_ms",
                "saved_prefill_ms",
            )
        ),
    ]
    query = select(UsageRecord.tenant_id, bucket, *columns).group_by(UsageRecord.tenant_id, bucket)
    if tenant_id is not None:
        query = query.where(UsageRecord.tenant_id == tenant_id)
    if start is not None:
        query = query.where(UsageRecord.created_hour >= _hour(start))
    if end is not None:
        query = query.where(UsageRecord.created_hour < _hour(end))
    async with sessionmaker() as session:
        result = (await session.execute(query.order_by(bucket, UsageRecord.tenant_id))).all()
        tenants = {row.id: row for row in await session.scalars(select(Tenant))}
    rows = []
    for record in result:
        tenant = tenants.get(record.tenant_id)
        prices = _prices_for(tenant, default_prices)
        prompt, cached = int(record.prompt_tokens), int(record.cached_tokens)
        uncached = max(prompt - cached, 0)
        cost_uncached = uncached * prices.input_per_mtok / 1e6
        cost_cached = cached * prices.cached_input_per_mtok / 1e6
        cost_output = int(record.completion_tokens) * prices.output_per_mtok / 1e6
        rows.append(
            ReportRow(
                tenant_id=record.tenant_id,
                tenant_name=None if tenant is None else tenant.name,
                period_start=datetime.fromtimestamp(int(record.bucket) * 3600, UTC).isoformat(),
                requests=int(record.requests),
                errors=int(record.errors or 0),
                prompt_tokens=prompt,
                cached_tokens=cached,
                uncached_prompt_tokens=uncached,
                completion_tokens=int(record.completion_tokens),
                hit_rate=round(cached / prompt, 6) if prompt else 0.0,
                cached_l1_tokens=int(record.cached_l1_tokens),
                cached_l2_tokens=int(record.cached_l2_tokens),
                cached_l3_tokens=int(record.cached_l3_tokens),
                cached_remote_tokens=int(record.cached_remote_tokens),
                prefill_s=round(float(record.prefill_ms) / 1000, 6),
                saved_prefill_s=round(float(record.saved_prefill_ms) / 1000, 6),
                cost_uncached_input=round(cost_uncached, 9),
                cost_cached_input=round(cost_cached, 9),
                cost_output=round(cost_output, 9),
                cost_total=round(cost_uncached + cost_cached + cost_output, 9),
                saved_cost=round(cached * (prices.input_per_mtok - prices.cached_input_per_mtok) / 1e6, 9),
            )
        )
    return rows


def _prices_for(tenant: Tenant | None, defaults: Prices) -> Prices:
    if tenant is None:
        return defaults
    return Prices(
        input_per_mtok=_or(tenant.price_input_per_mtok, defaults.input_per_mtok),
        cached_input_per_mtok=_or(tenant.price_cached_input_per_mtok, defaults.cached_input_per_mtok),
        output_per_mtok=_or(tenant.price_output_per_mtok, defaults.output_per_mtok),
    )


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


REPORT_FIELDS = tuple(ReportRow.__dataclass_fields__)


def report_to_csv(rows: list[ReportRow]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=REPORT_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow(asdict(row))
    return buffer.getvalue()


def report_totals(rows: list[ReportRow]) -> dict[str, float | int]:
    """Sums over all rows (hit rate recomputed from the sums)."""
    keys = [
        "requests",
        "errors",
        "prompt_tokens",
        "cached_tokens",
        "uncached_prompt_tokens",
        "completion_tokens",
        "prefill_s",
        "saved_prefill_s",
        "cost_uncached_input",
        "cost_cached_input",
        "cost_output",
        "cost_total",
        "saved_cost",
    ]
    totals: dict[str, float | int] = {key: sum(getattr(row, key) for row in rows) for key in keys}
    prompt = totals["prompt_tokens"]
    totals["hit_rate"] = round(totals["cached_tokens"] / prompt, 6) if prompt else 0.0
    return {key: round(value, 9) if isinstance(value, float) else value for key, value in totals.items()}
