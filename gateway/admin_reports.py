"""Admin routes over billing: usage reports, the per-request export, and usage records the database
refused (listed and retried)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable
from dataclasses import asdict
from datetime import UTC, date, datetime
from typing import Any

from aiohttp import web

from gateway.errors import InvalidRequest, Unavailable
from gateway.expect import expect_continue
from gateway.state import SESSIONMAKER, USAGE_WRITER
from tenancy.reports import (
    EXPORT_FIELDS,
    GRANULARITY_HOURS,
    REPORT_MAX_ROWS,
    export_requests,
    parse_cursor,
    parse_report_cursor,
    report_to_csv,
    rows_to_csv,
    usage_report_page,
    usage_totals,
)


def _time_query(request: web.Request, name: str) -> datetime | None:
    raw = request.query.get(name)
    if not raw:
        return None
    try:
        moment = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        try:
            moment = datetime.combine(date.fromisoformat(raw), datetime.min.time())
        except ValueError:
            raise InvalidRequest(f"'{name}' must be an ISO 8601 date or time", param=name) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _choice(request: web.Request, name: str, choices: tuple[str, ...], default: str) -> str:
    value = request.query.get(name, default)
    if value not in choices:
        raise InvalidRequest(f"'{name}' must be one of {', '.join(choices)}", param=name)
    return value


def query_limit(request: web.Request, default: int, maximum: int) -> int:
    """The ``limit`` query parameter: ASCII digits (``int`` alone takes ``+5``, ``1_000``, full-width
    digits), 1 to ``maximum``; else a 400 naming it."""
    raw = request.query.get("limit")
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 19):
        raise InvalidRequest("'limit' must be a positive integer", param="limit")
    value = int(raw)
    if not 1 <= value <= maximum:
        raise InvalidRequest(f"'limit' must be between 1 and {maximum}", param="limit")
    return value


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()


def _csv(
    text: str, filename: str, next_cursor: str | None, has_more: bool, held_back: bool | None = None
) -> web.Response:
    headers = {
        "Content-Disposition": f'attachment; filename="{filename}"',
        "X-Next-Cursor": next_cursor or "",
        "X-Has-More": "true" if has_more else "false",
    }
    if held_back is not None:
        headers["X-Held-Back"] = "true" if held_back else "false"
    return web.Response(text=text, content_type="text/csv", headers=headers)


async def _json(body: dict[str, Any], rows: Callable[[], Iterable[dict[str, Any]]]) -> web.Response:
    """``body`` and ``rows()`` as its "data", built and encoded in a thread, a row at a time: a page of
    10,000 rows held the loop ~0.5 s, and one ``json.dumps`` of it would hold the GIL throughout."""

    def encode() -> str:
        data = ",".join(json.dumps(row) for row in rows())
        return json.dumps(body)[:-1] + f', "data": [{data}]}}'

    return web.Response(text=await asyncio.to_thread(encode), content_type="application/json")


async def usage_report_handler(request: web.Request) -> web.Response:
    """GET /reports/usage: per tenant × model × key (× end user with group_by=end_user), hour or day, in
    pages of ``limit`` rows (``cursor``: the previous page's ``next_cursor``); totals of the whole report."""
    granularity = _choice(request, "granularity", tuple(GRANULARITY_HOURS), "day")
    output = _choice(request, "format", ("json", "csv"), "json")
    group_by = _choice(request, "group_by", ("key", "end_user"), "key")
    start, end = _time_query(request, "start"), _time_query(request, "end")
    tenant_id = request.query.get("tenant_id") or None
    cursor = request.query.get("cursor") or None
    if cursor is not None:
        try:
            parse_report_cursor(cursor, group_by == "end_user")
        except ValueError:
            raise InvalidRequest("'cursor' is not a cursor this report returned", param="cursor") from None
    sessionmaker = request.config_dict[SESSIONMAKER]
    page = await usage_report_page(
        sessionmaker,
        tenant_id=tenant_id,
        start=start,
        end=end,
        granularity=granularity,
        by_end_user=group_by == "end_user",
        cursor=cursor,
        limit=query_limit(request, 1000, REPORT_MAX_ROWS),
    )
    if output == "csv":
        text = await asyncio.to_thread(report_to_csv, page.rows)
        return _csv(text, "usage.csv", page.next_cursor, page.has_more)
    totals = await usage_totals(sessionmaker, tenant_id=tenant_id, start=start, end=end)
    body = {
        "object": "usage_report",
        "granularity": granularity,
        "group_by": group_by,
        "start": _iso(start),
        "end": _iso(end),
        "next_cursor": page.next_cursor,
        "has_more": page.has_more,
        "totals": totals,  # of the whole report, every page
    }
    return await _json(body, lambda: (asdict(row) for row in page.rows))


async def request_export_handler(request: web.Request) -> web.Response:
    """GET /reports/requests: one record per request, in write order, paged with ``cursor``."""
    output = _choice(request, "format", ("json", "csv"), "json")
    cursor = request.query.get("cursor") or None
    try:
        parse_cursor(cursor)
    except ValueError:
        raise InvalidRequest("'cursor' is not a cursor this API returned", param="cursor") from None
    page = await export_requests(
        request.config_dict[SESSIONMAKER],
        tenant_id=request.query.get("tenant_id") or None,
        start=_time_query(request, "start"),
        end=_time_query(request, "end"),
        cursor=cursor,
        limit=query_limit(request, 1000, 10_000),
    )
    if output == "csv":
        text = await asyncio.to_thread(rows_to_csv, page.data, EXPORT_FIELDS)
        return _csv(text, "requests.csv", page.next_cursor, page.has_more, page.held_back)
    body = {
        "object": "list",
        "next_cursor": page.next_cursor,
        "has_more": page.has_more,
        "held_back": page.held_back,  # records wait for a usage write still open: ask again shortly
    }
    return await _json(body, lambda: page.data)


async def rejected_list_handler(request: web.Request) -> web.Response:
    """GET /usage/rejected: usage records the database refused (kept aside, retried periodically)."""
    writer = request.config_dict[USAGE_WRITER]
    limit = query_limit(request, 100, 10_000)
    records = await asyncio.to_thread(writer.rejected.read)
    data: list[dict[str, Any]] = [event.to_json() for event in records[:limit]]
    return web.json_response({"object": "list", "total": len(records), "data": data})


async def rejected_retry_handler(request: web.Request) -> web.Response:
    """POST /usage/rejected/retry: try them again now."""
    try:
        stored, still_rejected = await request.config_dict[USAGE_WRITER].retry_rejected()
    except Exception as exc:  # the database is unreachable: nothing was lost, try again later
        raise Unavailable(f"the usage database is unavailable: {exc.__class__.__name__}") from exc
    return web.json_response({"stored": stored, "rejected": still_rejected})


def add_routes(admin: web.Application) -> None:
    admin.router.add_get("/reports/usage", usage_report_handler, expect_handler=expect_continue)
    admin.router.add_get("/reports/requests", request_export_handler, expect_handler=expect_continue)
    admin.router.add_get("/usage/rejected", rejected_list_handler, expect_handler=expect_continue)
    admin.router.add_post("/usage/rejected/retry", rejected_retry_handler, expect_handler=expect_continue)
