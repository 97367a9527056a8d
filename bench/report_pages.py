"""How long a usage report holds the gateway's event loop: main's one unbounded answer built on the loop,
against the paged report built off it (review r1, finding 3), same database, same run.

    python -m bench.report_pages [--users 100000] [--postgres-url postgresql+asyncpg://postgres@127.0.0.1:5432/test]

A private PostgreSQL database (created and dropped here) holds ``--users`` requests of one tenant in the
current hour, each from its own end user (the `user` field): ``group_by=end_user&granularity=hour`` has
one row per request. In the real app (in this process), a ticker sleeping 5 ms measures the loop's
largest lag (what every tenant's request would wait) while

- ``main``: main's handler code, run on the loop: the whole report in one query, rows, ``asdict``,
  ``report_totals`` and ``web.json_response``'s ``json.dumps``;
- ``now``: ``GET /admin/v1/reports/usage`` page after page (``limit=10000``, following ``next_cursor``),
  and one ``GET /admin/v1/reports/requests?limit=10000``.

Alternated twice (best of 2 each). The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from gateway.app import create_app
from gateway.state import SESSIONMAKER
from migrations import upgrade_database_async
from tenancy.models import UsageRecord
from tenancy.reports import _report_row, _sums, report_totals
from tenancy.usage import insert_usage
from tenancy.usage_types import Prices, UsageEvent
from tests.gateway.conftest import ADMIN, make_config
from tests.tenancy.db_support import _pg_admin

PRICES = Prices(input_per_mtok=1.0, cached_input_per_mtok=0.1, output_per_mtok=2.0)
REPORT = "/admin/v1/reports/usage"
QUERY = {"group_by": "end_user", "granularity": "hour"}


async def main_report(sessionmaker: Any) -> int:
    """main's usage_report_handler, on the loop: one query, every row, one json.dumps (bytes returned)."""
    u = UsageRecord
    bucket = (u.created_hour - u.created_hour % 1).label("bucket")
    keys = [u.tenant_id, u.model, u.key_id, u.end_user, bucket]
    query = select(*keys, func.max(u.tenant_name).label("tenant_name"), *_sums()).group_by(*keys)
    async with sessionmaker() as session:
        result = (await session.execute(query.order_by(bucket, *keys[:-1]))).all()
    rows = [_report_row(record, True) for record in result]
    body = {"object": "usage_report", "data": [asdict(row) for row in rows], "totals": report_totals(rows)}
    return len(json.dumps(body))


async def now_report(client: TestClient) -> int:
    """Every page of the paged report, and one export page of 10,000 (bytes received)."""
    size, cursor = 0, None
    while True:
        params = {**QUERY, "limit": "10000", **({"cursor": cursor} if cursor else {})}
        response = await client.get(REPORT, params=params, headers=ADMIN)
        raw = await response.read()
        size += len(raw)
        # Only the head (the gateway writes "data" last): decoding 10,000 rows here would be the
        # bench's own loop lag, not the gateway's.
        page = json.loads(raw[: raw.index(b', "data": [')] + b"}")
        if not page["has_more"]:
            break
        cursor = page["next_cursor"]
    export = await client.get("/admin/v1/reports/requests", params={"limit": "10000"}, headers=ADMIN)
    return size + len(await export.read())


async def lag_while(work: Callable[[], Awaitable[int]]) -> dict[str, float]:
    lags: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - last - 0.005)
            last = time.perf_counter()

    task = asyncio.create_task(ticker())
    started = time.perf_counter()
    size = await work()
    elapsed = time.perf_counter() - started
    done.set()
    await task
    return {"elapsed_s": round(elapsed, 3), "loop_max_lag_s": round(max(lags), 3), "mb": round(size / 1e6, 1)}


def busy_events(indices: range, now: datetime) -> list[UsageEvent]:
    """Requests of one tenant ``tn_busy`` at ``now``, each from its own end user."""
    return [
        UsageEvent(
            request_id=f"busy-{i}",
            tenant_id="tn_busy",
            model="m",
            endpoint="chat.completions",
            status=200,
            end_user=f"user-{i:06d}",
            prompt_tokens=100,
            completion_tokens=5,
            prices=PRICES,
            created_at=now,
        )
        for i in indices
    ]


async def run(users: int, postgres_url: str) -> dict[str, Any]:
    name = f"prefixgate_bench_{secrets.token_hex(4)}"
    await _pg_admin(postgres_url, f'CREATE DATABASE "{name}"')
    url = make_url(postgres_url).set(database=name).render_as_string(hide_password=False)
    try:
        await upgrade_database_async(url)
        with tempfile.TemporaryDirectory() as data_dir:
            client = TestClient(TestServer(create_app(make_config(url, Path(data_dir)))))
            await client.start_server()
            try:
                sessionmaker = client.app[SESSIONMAKER]
                now = datetime.now(UTC)
                for start in range(0, users, 10_000):
                    batch = range(start, min(users, start + 10_000))
                    await insert_usage(sessionmaker, busy_events(batch, now))
                results: dict[str, list[dict[str, float]]] = {"main": [], "now": []}
                for _ in range(2):
                    results["main"].append(await lag_while(lambda: main_report(sessionmaker)))
                    results["now"].append(await lag_while(lambda: now_report(client)))
            finally:
                await client.close()
    finally:
        await _pg_admin(postgres_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    best = {key: min(runs, key=lambda r: r["loop_max_lag_s"]) for key, runs in results.items()}
    return {"users": users, **best, "runs": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=100_000)
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get(
            "PREFIXGATE_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
        ),
    )
    args = parser.parse_args()
    result = asyncio.run(run(args.users, args.postgres_url))
    print(f"{args.users} rows (one per end user, one hour); load average {os.getloadavg()}")
    print(f"{'':6} {'elapsed s':>10} {'loop max lag s':>15} {'MB':>6}")
    for key in ("main", "now"):
        row = result[key]
        print(f"{key:6} {row['elapsed_s']:>10} {row['loop_max_lag_s']:>15} {row['mb']:>6}")
    ratio = result["main"]["loop_max_lag_s"] / max(result["now"]["loop_max_lag_s"], 1e-3)
    result.update(lag_ratio_main_to_now=round(ratio, 1), loadavg=[round(x, 2) for x in os.getloadavg()])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
