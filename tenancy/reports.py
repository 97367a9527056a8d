"""Usage reports: per tenant × model × key (and end user on request), by hour or day, in pages that
follow a cursor, with totals over the whole report; plus a per-request export with a cursor.

Every figure is a sum of what the records froze when their requests ran (delivered tokens, unit
prices, cost, the tenant's name): changing a tenant's prices, renaming or deleting it never changes a
report of the past.
"""

from __future__ import annotations

import asyncio
import base64
import csv
import io
import json
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, Select, case, func, literal, select, tuple_
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenancy.models import UsageRecord
from tenancy.usage_types import OUTCOME_CANCELLED_ESTIMATED, OUTCOME_CLIENT_CANCELLED
from tenancy.write_order import settled_below

CANCELLED_OUTCOMES = (OUTCOME_CLIENT_CANCELLED, OUTCOME_CANCELLED_ESTIMATED)  # the client went away

GRANULARITY_HOURS = {"hour": 1, "day": 24}
_FETCH_CHUNK_ROWS = 500
REPORT_MAX_ROWS = 10_000  # the most rows one page of the usage report holds (one row per group and period)
_COSTS = ("cost_uncached_input", "cost_cached_input", "cost_output", "cost_total")
_UNBILLED = ("unbilled_requests", "unbilled_prompt_tokens", "unbilled_completion_tokens")
_SUMMED = (
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "cached_l1_tokens",
    "cached_l2_tokens",
    "cached_l3_tokens",
    "cached_remote_tokens",
    "prefill_ms",
    "saved_prefill_ms",
    "cost_uncached_input",
    "cost_cached_input",
    "cost_output",
    "cost_total",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReportRow:
    tenant_id: str
    tenant_name: str | None  # as recorded when the requests ran
    model: str
    key_id: str | None
    end_user: str | None  # only when grouped by end user
    period_start: str  # ISO 8601, UTC
    requests: int
    errors: int  # HTTP status >= 400 (a stream cut after its headers keeps its 200)
    cancelled: int  # ended by the client
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
    saved_cost: float  # what the cached tokens would have cost more at the uncached input price
    # Of the requests and tokens above, those not billable (format_error: used, nothing delivered, cost 0).
    unbilled_requests: int
    unbilled_prompt_tokens: int
    unbilled_completion_tokens: int


def _hour(moment: datetime) -> int:
    moment = moment if moment.tzinfo else moment.replace(tzinfo=UTC)
    return int(moment.timestamp() // 3600)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReportPage:
    rows: list[ReportRow]
    next_cursor: str | None  # pass back as ``cursor`` for the next page; None after the last page
    has_more: bool


def _sums() -> list[ColumnElement]:
    """The summed columns of a report row (or of the totals)."""
    u = UsageRecord
    saved = u.cached_tokens * (u.price_input_per_mtok - u.price_cached_input_per_mtok) / 1e6
    return [
        func.count().label("requests"),
        func.sum(case((u.status >= 400, 1), else_=0)).label("errors"),
        func.sum(case((u.outcome.in_(CANCELLED_OUTCOMES), 1), else_=0)).label("cancelled"),
        *(func.coalesce(func.sum(getattr(u, name)), 0).label(name) for name in _SUMMED),
        func.coalesce(func.sum(saved), 0).label("saved_cost"),
        func.sum(case((u.billable.is_(False), 1), else_=0)).label("unbilled_requests"),
        func.sum(case((u.billable.is_(False), u.prompt_tokens), else_=0)).label("unbilled_prompt_tokens"),
        func.sum(case((u.billable.is_(False), u.completion_tokens), else_=0)).label(
            "unbilled_completion_tokens"
        ),
    ]


def _within(query: Select, tenant_id: str | None, start: datetime | None, end: datetime | None) -> Select:
    u = UsageRecord
    if tenant_id is not None:
        query = query.where(u.tenant_id == tenant_id)
    if start is not None:
        query = query.where(u.created_hour >= _hour(start))
    if end is not None:
        query = query.where(u.created_hour < _hour(end))
    return query


def _row_order(bucket: ColumnElement, by_end_user: bool) -> list[ColumnElement]:
    """The row order, which a cursor continues: NULL sorts first on SQLite and last on PostgreSQL, so a
    nullable key sorts (and compares) by whether it is set, then by its value."""
    u = UsageRecord
    order: list[ColumnElement] = [bucket, u.tenant_id, u.model]
    for column in (u.key_id, *([u.end_user] if by_end_user else [])):
        order += [case((column.is_(None), 0), else_=1), func.coalesce(column, "")]
    return order


def _cursor_of(record: Any, by_end_user: bool) -> str:
    values: list[Any] = [int(record.bucket), record.tenant_id, record.model]
    for value in (record.key_id, *([record.end_user] if by_end_user else [])):
        values += [0 if value is None else 1, value or ""]
    return base64.urlsafe_b64encode(json.dumps(values, separators=(",", ":")).encode()).decode()


def parse_report_cursor(cursor: str, by_end_user: bool) -> list[Any]:
    """The row position in a report cursor; ValueError if it is not one this grouping returned."""
    try:
        values = json.loads(base64.urlsafe_b64decode(cursor.encode("ascii")))
    except (UnicodeError, ValueError, TypeError) as exc:  # binascii.Error is a ValueError
        raise ValueError("not a report cursor") from exc
    kinds = [int, str, str, int, str, *([int, str] if by_end_user else [])]
    if not isinstance(values, list) or len(values) != len(kinds):
        raise ValueError("not a cursor of this report's grouping")
    if not all(type(value) is kind for value, kind in zip(values, kinds, strict=True)):
        raise ValueError("not a report cursor")
    if not 0 <= values[0] < 2**31 or any(values[i] not in (0, 1) for i in range(3, len(values), 2)):
        raise ValueError("cursor out of range")
    u = UsageRecord
    texts = zip(
        [values[1], values[2], *values[4::2]], (u.tenant_id, u.model, u.key_id, u.end_user), strict=False
    )
    if not all(_sendable(text, column.type.length) for text, column in texts):
        raise ValueError("cursor out of range")
    return values


def _sendable(text: str, max_chars: int) -> bool:
    """Whether a cursor string fits its column and every driver can send it: no NUL (PostgreSQL text
    refuses it) and nothing that does not encode to UTF-8 (a lone surrogate from a JSON escape)."""
    if len(text) > max_chars or "\x00" in text:
        return False
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


async def usage_report_page(
    sessionmaker: async_sessionmaker[AsyncSession],
    *,
    tenant_id: str | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
    granularity: str = "day",
    by_end_user: bool = False,
    cursor: str | None = None,
    limit: int | None = REPORT_MAX_ROWS,
) -> ReportPage:
    """Rows per (tenant, model, key[, end user], period), oldest period first, after ``cursor`` (the
    ``next_cursor`` of the previous page), at most ``limit`` (None: all). ``start`` is inclusive and
    ``end`` exclusive, both rounded down to the hour. The rows are built off the event loop; rows of an
    hour still running may gain requests between pages. ValueError: a cursor this grouping never returned."""
    step = GRANULARITY_HOURS[granularity]
    u = UsageRecord
    bucket = (u.created_hour - u.created_hour % step).label("bucket")
    keys = [u.tenant_id, u.model, u.key_id, *([u.end_user] if by_end_user else []), bucket]
    order = _row_order(bucket, by_end_user)
    query = select(*keys, func.max(u.tenant_name).label("tenant_name"), *_sums()).group_by(*keys)
    query = _within(query, tenant_id, start, end)
    if cursor:
        after = parse_report_cursor(cursor, by_end_user)
        query = query.where(tuple_(*order) > tuple_(*(literal(value) for value in after)))
    query = query.order_by(*order)
    if limit is not None:
        query = query.limit(limit + 1)
    result = await _fetch(sessionmaker, query)
    more = limit is not None and len(result) > limit
    result = result[:limit] if more else result
    rows = await asyncio.to_thread(lambda: [_report_row(record, by_end_user) for record in result])
    return ReportPage(
        rows=rows, next_cursor=_cursor_of(result[-1], by_end_user) if more else None, has_more=more
    )


async def usage_report(
    sessionmaker: async_sessionmaker[AsyncSession],
    *,
    tenant_id: str | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
    granularity: str = "day",
    by_end_user: bool = False,
) -> list[ReportRow]:
    """The whole report in one list (unbounded: for tests and small ranges; the admin API pages)."""
    page = await usage_report_page(
        sessionmaker,
        tenant_id=tenant_id,
        start=start,
        end=end,
        granularity=granularity,
        by_end_user=by_end_user,
        limit=None,
    )
    return page.rows


async def usage_totals(
    sessionmaker: async_sessionmaker[AsyncSession],
    *,
    tenant_id: str | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
) -> dict[str, float | int]:
    """``report_totals`` of the whole report (every page), summed by the database."""
    u = UsageRecord
    uncached = func.coalesce(
        func.sum(case((u.prompt_tokens > u.cached_tokens, u.prompt_tokens - u.cached_tokens), else_=0)), 0
    )
    query = _within(select(*_sums(), uncached.label("uncached_prompt_tokens")), tenant_id, start, end)
    async with sessionmaker() as session:
        record = (await session.execute(query)).one()
    totals: dict[str, float | int] = {
        "requests": int(record.requests),
        "errors": int(record.errors or 0),
        "cancelled": int(record.cancelled or 0),
        "prompt_tokens": int(record.prompt_tokens),
        "cached_tokens": int(record.cached_tokens),
        "uncached_prompt_tokens": int(record.uncached_prompt_tokens),
        "completion_tokens": int(record.completion_tokens),
        "prefill_s": float(record.prefill_ms) / 1000,
        "saved_prefill_s": float(record.saved_prefill_ms) / 1000,
        **{name: float(getattr(record, name)) for name in _COSTS},
        "saved_cost": float(record.saved_cost),
        **{name: int(getattr(record, name) or 0) for name in _UNBILLED},
    }
    return _rounded_totals(totals)


def _report_row(record: Any, by_end_user: bool) -> ReportRow:
    prompt, cached = int(record.prompt_tokens), int(record.cached_tokens)
    return ReportRow(
        tenant_id=record.tenant_id,
        tenant_name=record.tenant_name,
        model=record.model,
        key_id=record.key_id,
        end_user=record.end_user if by_end_user else None,
        period_start=datetime.fromtimestamp(int(record.bucket) * 3600, UTC).isoformat(),
        requests=int(record.requests),
        errors=int(record.errors or 0),
        cancelled=int(record.cancelled or 0),
        prompt_tokens=prompt,
        cached_tokens=cached,
        uncached_prompt_tokens=max(prompt - cached, 0),
        completion_tokens=int(record.completion_tokens),
        hit_rate=round(cached / prompt, 6) if prompt else 0.0,
        cached_l1_tokens=int(record.cached_l1_tokens),
        cached_l2_tokens=int(record.cached_l2_tokens),
        cached_l3_tokens=int(record.cached_l3_tokens),
        cached_remote_tokens=int(record.cached_remote_tokens),
        prefill_s=round(float(record.prefill_ms) / 1000, 6),
        saved_prefill_s=round(float(record.saved_prefill_ms) / 1000, 6),
        cost_uncached_input=round(float(record.cost_uncached_input), 9),
        cost_cached_input=round(float(record.cost_cached_input), 9),
        cost_output=round(float(record.cost_output), 9),
        cost_total=round(float(record.cost_total), 9),
        saved_cost=round(float(record.saved_cost), 9),
        **{name: int(getattr(record, name) or 0) for name in _UNBILLED},
    )


# --- per-request export --------------------------------------------------------------------------

EXPORT_FIELDS = (
    "request_id",
    "created_at",
    "tenant_id",
    "tenant_name",
    "key_id",
    "end_user",
    "model",
    "endpoint",
    "status",
    "outcome",
    "prompt_tokens",
    "cached_tokens",
    "cached_l1_tokens",
    "cached_l2_tokens",
    "cached_l3_tokens",
    "cached_remote_tokens",
    "completion_tokens",
    "price_input_per_mtok",
    "price_cached_input_per_mtok",
    "price_output_per_mtok",
    "cost_uncached_input",
    "cost_cached_input",
    "cost_output",
    "cost_total",
    "billable",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportPage:
    data: list[dict[str, Any]]
    next_cursor: str | None  # pass back as ``cursor`` for the next page (later records arrive after it)
    has_more: bool  # more records are waiting right now
    held_back: bool = False  # some wait for a usage write still open (see export_requests)


async def export_requests(
    sessionmaker: async_sessionmaker[AsyncSession],
    *,
    tenant_id: str | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
    cursor: str | None = None,
    limit: int = 1000,
) -> ExportPage:
    """One page of records after ``cursor`` (the position of the previous page's last record).

    A consumer that follows the cursor sees every record once. PostgreSQL gives a row its id on insert
    and shows it on commit, so ids commit out of order (two replicas flushing at once, a timed-out insert
    that commits later): records come in the order of the transactions that wrote them (``xact_id``, then
    id), and only those below every usage write still open, whose records would come before them
    (``tenancy.write_order``: other transactions, in this database or any other, hold nothing back). A
    record is thus held back while an older usage write is open; the page then has ``held_back`` and
    ``has_more`` set, since it is not the end. SQLite serializes writes: id order. Records replayed late
    from a spool are written late, so they come after the cursor too."""
    after = parse_cursor(cursor)
    u = UsageRecord
    query = select(u.id, u.xact_id, *(getattr(u, name) for name in EXPORT_FIELDS))
    query = query.where(tuple_(u.xact_id, u.id) > tuple_(literal(after[0]), literal(after[1])))
    if tenant_id is not None:
        query = query.where(u.tenant_id == tenant_id)
    if start is not None:
        query = query.where(u.created_hour >= _hour(start))
    if end is not None:
        query = query.where(u.created_hour < _hour(end))
    bound = None
    async with sessionmaker() as session:  # its own transaction: the query's snapshot comes after it
        if session.bind is not None and session.bind.dialect.name == "postgresql":
            bound = await settled_below(session)
    settled = query if bound is None else query.where(u.xact_id < bound)
    rows = await _fetch(sessionmaker, settled.order_by(u.xact_id, u.id).limit(limit + 1))
    more = len(rows) > limit
    rows = rows[:limit]
    held_back = not more and bound is not None and await _any(sessionmaker, query.where(u.xact_id >= bound))
    data = await asyncio.to_thread(lambda: [_export_row(row) for row in rows])  # off the event loop
    next_cursor = _export_cursor(rows[-1]) if rows else cursor
    return ExportPage(data=data, next_cursor=next_cursor, has_more=more or held_back, held_back=held_back)


async def _any(sessionmaker: async_sessionmaker[AsyncSession], query: Select) -> bool:
    async with sessionmaker() as session:
        return (await session.execute(query.limit(1))).first() is not None


def _export_cursor(row: Any) -> str:
    """``xact_id.id``, or the bare id when ``xact_id`` is 0 (SQLite; rows older than migration 0008)."""
    return f"{row.xact_id}.{row.id}" if row.xact_id else str(row.id)


async def _fetch(sessionmaker: async_sessionmaker[AsyncSession], query: Select) -> list[Any]:
    """The query's rows, read in chunks that each give the event loop back (10,000 rows at once held
    it ~0.2-0.9 s decoding them, as ORM objects the longest)."""
    rows: list[Any] = []
    async with sessionmaker() as session:
        result = await session.stream(query)
        async for chunk in result.partitions(_FETCH_CHUNK_ROWS):
            rows += chunk
            await asyncio.sleep(0)
    return rows


def parse_cursor(cursor: str | None) -> tuple[int, int]:
    """The (transaction id, row id) position in an export cursor (``xact_id.id``, or a bare id: the
    transaction id 0); ValueError if it is not one of ours."""
    if not cursor:
        return 0, 0
    parts = cursor.split(".") if cursor.count(".") == 1 else ["0", cursor]
    for part in parts:
        if not (part.isascii() and part.isdigit() and len(part) <= 19):  # int() takes +5, 1_000, ５
            raise ValueError("not a cursor")
    xact_id, row_id = (int(part) for part in parts)
    if not (xact_id < 2**63 and row_id < 2**63):  # both are BIGINTs
        raise ValueError("cursor out of range")
    return xact_id, row_id


def _export_row(row: Any) -> dict[str, Any]:
    data = {name: getattr(row, name) for name in EXPORT_FIELDS}
    created = row.created_at if row.created_at.tzinfo else row.created_at.replace(tzinfo=UTC)
    data["created_at"] = created.isoformat()
    return data


# --- output ----------------------------------------------------------------------------------------

REPORT_FIELDS = tuple(ReportRow.__dataclass_fields__)
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "\n")


def csv_safe(value: Any) -> Any:
    """A cell a spreadsheet will not run as a formula: text starting with = + - @ or a control
    character gets a leading apostrophe (OWASP's advice). Numbers are left alone."""
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def rows_to_csv(rows: list[dict[str, Any]], fields: tuple[str, ...], *, header: bool = True) -> str:
    """CSV of ``rows`` (``csv_safe`` cells), with the header line unless ``header`` is False (a page
    after the first)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fields, lineterminator="\n")
    if header:
        writer.writeheader()
    for row in rows:
        writer.writerow({name: csv_safe(row.get(name)) for name in fields})
    return buffer.getvalue()


def report_to_csv(rows: list[ReportRow]) -> str:
    return rows_to_csv([asdict(row) for row in rows], REPORT_FIELDS)


def report_totals(rows: list[ReportRow]) -> dict[str, float | int]:
    """Sums over all rows (hit rate recomputed from the sums)."""
    keys = [
        "requests",
        "errors",
        "cancelled",
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
        *_UNBILLED,
    ]
    return _rounded_totals({key: sum(getattr(row, key) for row in rows) for key in keys})


def _rounded_totals(totals: dict[str, float | int]) -> dict[str, float | int]:
    prompt = totals["prompt_tokens"]
    totals["hit_rate"] = round(totals["cached_tokens"] / prompt, 6) if prompt else 0.0
    return {key: round(value, 9) if isinstance(value, float) else value for key, value in totals.items()}
