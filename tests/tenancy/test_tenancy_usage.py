import asyncio
import base64
import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, insert, select, text

from migrations import upgrade_database_async
from tenancy.db import create_engine, create_sessionmaker
from tenancy.models import UsageRecord
from tenancy.reports import (
    export_requests,
    parse_cursor,
    report_to_csv,
    report_totals,
    usage_report,
    usage_report_page,
    usage_totals,
)
from tenancy.spool import UsageSpool
from tenancy.usage import UsageWriter, insert_usage
from tenancy.usage_types import Prices, UsageEvent


def event(request_id: str, **kwargs) -> UsageEvent:
    values = {
        "tenant_id": "tn_a",
        "model": "m",
        "endpoint": "chat.completions",
        "status": 200,
        "prompt_tokens": 100,
        "cached_tokens": 64,
        "cached_tokens_by_tier": {"l1": 48, "l3": 16},
        "completion_tokens": 10,
        "prefill_ms": 5.0,
        "saved_prefill_ms": 20.0,
    }
    values.update(kwargs)
    return UsageEvent(request_id=request_id, **values)


async def count(sessionmaker) -> int:
    async with sessionmaker() as session:
        return await session.scalar(select(func.count()).select_from(UsageRecord))


async def test_insert_is_idempotent(db_url):
    engine = create_engine(db_url)
    sessionmaker = create_sessionmaker(engine)
    await insert_usage(sessionmaker, [event("r1"), event("r2")])
    await insert_usage(sessionmaker, [event("r2"), event("r3")])
    assert await count(sessionmaker) == 3
    async with sessionmaker() as session:
        row = await session.scalar(select(UsageRecord).where(UsageRecord.request_id == "r1"))
    assert (row.cached_l1_tokens, row.cached_l3_tokens, row.cached_remote_tokens) == (48, 16, 0)
    await engine.dispose()


async def test_outage_spools_then_replays_once(tmp_path: Path):
    """The database is unreachable (its folder does not exist yet), then comes back."""
    db_path = tmp_path / "later" / "usage.db"
    url = f"sqlite+aiosqlite:///{db_path}"
    engine = create_engine(url)
    sessionmaker = create_sessionmaker(engine)
    spool = UsageSpool(tmp_path / "spool.jsonl")
    writer = UsageWriter(sessionmaker, spool, flush_s=0.01)
    for i in range(5):
        writer.submit(event(f"r{i}"))
    await writer.flush()
    assert spool.depth() == 5 and writer.num_spooled == 5 and writer.pending == 0

    await upgrade_database_async(url)  # the database returns
    writer.submit(event("r5"))
    deadline = time.monotonic() + 5
    while True:  # the writer leaves the database alone for its backoff (50 ms here), then replays
        await writer.flush()
        if spool.depth() == 0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    assert spool.depth() == 0 and await count(sessionmaker) == 6

    # A crash between replay and truncation replays the same records: nothing is counted twice.
    spool.append([event("r0"), event("r1")])
    await writer.close()
    assert spool.depth() == 0 and await count(sessionmaker) == 6
    await engine.dispose()


async def test_restart_replays_spool_left_by_previous_process(tmp_path: Path, sqlite_url: str):
    spool_path = tmp_path / "spool.jsonl"
    UsageSpool(spool_path).append([event("a"), event("b")])
    with open(spool_path, "a") as handle:
        handle.write('{"request_id": "torn"')  # killed mid-write
    engine = create_engine(sqlite_url)
    sessionmaker = create_sessionmaker(engine)
    writer = UsageWriter(sessionmaker, UsageSpool(spool_path))
    await writer.flush()
    assert await count(sessionmaker) == 2 and UsageSpool(spool_path).depth() == 0
    await engine.dispose()


PRICED = Prices(input_per_mtok=10.0, cached_input_per_mtok=1.0, output_per_mtok=20.0)
DEFAULTS = Prices(input_per_mtok=1.0, cached_input_per_mtok=0.1, output_per_mtok=2.0)


async def test_report_sums_the_prices_frozen_in_each_record(db_url):
    """Prices are applied when a request runs: changing or deleting the tenant later changes nothing."""
    engine = create_engine(db_url)
    sessionmaker = create_sessionmaker(engine)
    from tenancy.repository import TenantRepository

    repo = TenantRepository(sessionmaker)
    priced, _ = await repo.create_tenant({"name": "priced"})
    day = datetime(2026, 3, 1, 10, 30, tzinfo=UTC)
    common = {"tenant_id": priced.tenant_id, "tenant_name": "priced", "key_id": "key_1"}
    await insert_usage(
        sessionmaker,
        [
            event(
                "p1",
                **common,
                created_at=day,
                prompt_tokens=1_000_000,
                cached_tokens=500_000,
                completion_tokens=100_000,
                prices=PRICED,
            ),
            event(
                "p2",
                **common,
                created_at=day + timedelta(hours=1),
                status=502,
                outcome="server_error",
                prompt_tokens=0,
                cached_tokens=0,
                completion_tokens=0,
                cached_tokens_by_tier={},
                prices=PRICED,
            ),
            event(
                "d1",
                tenant_id="tn_deleted",
                tenant_name="gone",
                created_at=day + timedelta(days=1),
                prices=DEFAULTS,
            ),
        ],
    )
    await repo.update_tenant(priced.tenant_id, {"price_input_per_mtok": 999.0, "name": "renamed"})
    rows = await usage_report(sessionmaker, granularity="day")
    assert [(r.tenant_id, r.period_start) for r in rows] == [
        (priced.tenant_id, "2026-03-01T00:00:00+00:00"),
        ("tn_deleted", "2026-03-02T00:00:00+00:00"),
    ]
    first = rows[0]
    assert (first.requests, first.errors, first.prompt_tokens, first.cached_tokens) == (
        2,
        1,
        1_000_000,
        500_000,
    )
    assert first.hit_rate == 0.5 and first.tenant_name == "priced" and first.key_id == "key_1"
    assert first.cost_uncached_input == 5.0 and first.cost_cached_input == 0.5 and first.cost_output == 2.0
    assert first.cost_total == 7.5 and first.saved_cost == 4.5
    assert rows[1].tenant_name == "gone" and rows[1].cost_output == 10 * 2.0 / 1e6

    await repo.delete_tenant(priced.tenant_id)
    assert await usage_report(sessionmaker, granularity="day") == rows

    hourly = await usage_report(
        sessionmaker,
        granularity="hour",
        tenant_id=priced.tenant_id,
        start=day,
        end=day + timedelta(hours=1),
    )
    assert [(r.period_start, r.requests) for r in hourly] == [("2026-03-01T10:00:00+00:00", 1)]
    totals = report_totals(rows)
    assert totals["requests"] == 3 and totals["prompt_tokens"] == 1_000_100
    csv_text = report_to_csv(rows)
    assert csv_text.splitlines()[0].startswith("tenant_id,tenant_name,model,key_id,end_user,period_start")
    assert len(csv_text.splitlines()) == 3
    await engine.dispose()


async def test_report_by_model_key_and_end_user_and_csv_is_formula_safe(sqlite_url):
    engine = create_engine(sqlite_url)
    sessionmaker = create_sessionmaker(engine)
    day = datetime(2026, 3, 1, 10, 30, tzinfo=UTC)
    evil = '=HYPERLINK("http://x","y")'
    await insert_usage(
        sessionmaker,
        [
            event("a", key_id="key_1", end_user="alice", created_at=day, prices=DEFAULTS),
            event("b", key_id="key_1", end_user="bob", created_at=day, prices=DEFAULTS),
            event("c", key_id="key_2", end_user="alice", created_at=day, prices=DEFAULTS),
            event("d", key_id="key_2", model="other", end_user=evil, tenant_name="+cmd", created_at=day),
        ],
    )
    by_key = await usage_report(sessionmaker)
    assert [(r.model, r.key_id, r.requests, r.end_user) for r in by_key] == [
        ("m", "key_1", 2, None),
        ("m", "key_2", 1, None),
        ("other", "key_2", 1, None),
    ]
    by_user = await usage_report(sessionmaker, by_end_user=True)
    assert [(r.model, r.key_id, r.end_user) for r in by_user] == [
        ("m", "key_1", "alice"),
        ("m", "key_1", "bob"),
        ("m", "key_2", "alice"),
        ("other", "key_2", evil),
    ]
    text = report_to_csv(by_user)
    assert "'=HYPERLINK" in text and "'+cmd" in text
    assert not any(cell.startswith(("=", "+", "@")) for line in text.splitlines() for cell in line.split(","))
    await engine.dispose()


async def test_per_request_export_pages_with_a_cursor(sqlite_url):
    engine = create_engine(sqlite_url)
    sessionmaker = create_sessionmaker(engine)
    await insert_usage(sessionmaker, [event(f"r{i:02d}", prices=DEFAULTS) for i in range(25)])
    seen, cursor = [], None
    while True:
        page = await export_requests(sessionmaker, cursor=cursor, limit=10)
        seen += [row["request_id"] for row in page.data]
        cursor = page.next_cursor
        if not page.has_more:
            break
    assert seen == [f"r{i:02d}" for i in range(25)]
    first = (await export_requests(sessionmaker, limit=1)).data[0]
    assert first["cost_total"] == event("x", prices=DEFAULTS).cost.total > 0
    assert first["outcome"] == "completed" and first["price_output_per_mtok"] == 2.0
    # Records stored later (a spool replayed) come after the cursor: a consumer never misses them.
    await insert_usage(sessionmaker, [event("late", prices=DEFAULTS)])
    page = await export_requests(sessionmaker, cursor=cursor)
    assert [row["request_id"] for row in page.data] == ["late"]
    await engine.dispose()


async def _follow_export(sessionmaker, cursor: str | None, wanted: int) -> tuple[list[str], str | None]:
    """The request ids the export hands out after ``cursor`` until ``wanted`` came (or 10 s passed)."""
    seen: list[str] = []
    deadline = time.monotonic() + 10
    while len(seen) < wanted and time.monotonic() < deadline:
        page = await export_requests(sessionmaker, cursor=cursor)
        seen += [row["request_id"] for row in page.data]
        cursor = page.next_cursor
        await asyncio.sleep(0 if page.data else 0.05)
    return seen, cursor


async def test_the_export_cursor_never_passes_a_record_still_being_written(pg_url):
    """PostgreSQL takes a row's id when it is inserted and shows the row when its transaction commits:
    two replicas flushing at once (or a timed-out insert that commits later) commit out of id order.
    A consumer following the cursor past a later id never saw the earlier one (review r6 #3). The
    export now hands out records only below every usage write still open, in the order of
    their transactions, so it holds the later record back until the earlier one commits."""
    engine = create_engine(pg_url)
    sessionmaker = create_sessionmaker(engine)
    async with sessionmaker() as slow:  # replica A: its insert took id 1, its commit is still to come
        await slow.execute(insert(UsageRecord).values(event("slow_a").to_row()))
        await insert_usage(sessionmaker, [event("fast_b")])  # replica B: id 2, committed
        early = await export_requests(sessionmaker)
        assert early.data == [] and early.has_more and early.held_back  # fast_b waits for slow_a's
        await slow.commit()
    seen, cursor = await _follow_export(sessionmaker, early.next_cursor, 2)
    assert seen == ["slow_a", "fast_b"]
    # The other interleaving: C's transaction began writing before D took the lower id and committed
    # late: C's record comes first (its transaction is older), D's once it commits, none is skipped.
    # C's INSERT took its lock on usage_records, then its transaction id (tenancy.write_order), and was
    # slow to take its row id: C is older, its record's id higher.
    async with sessionmaker() as older, sessionmaker() as later:
        await older.execute(text("LOCK TABLE usage_records IN ROW EXCLUSIVE MODE"))
        await older.execute(text("SELECT pg_current_xact_id()"))  # older's transaction id comes first
        await later.execute(insert(UsageRecord).values(event("later_d").to_row()))
        await older.execute(insert(UsageRecord).values(event("older_c").to_row()))
        await older.commit()
        seen, cursor = await _follow_export(sessionmaker, cursor, 1)
        assert seen == ["older_c"]
        await later.commit()
    seen, cursor = await _follow_export(sessionmaker, cursor, 1)
    assert seen == ["later_d"]
    assert (await export_requests(sessionmaker, cursor=cursor)).data == []
    assert (await _follow_export(sessionmaker, None, 4))[0] == ["slow_a", "fast_b", "older_c", "later_d"]
    await engine.dispose()


async def test_sqlite_serializes_writes_so_the_export_goes_in_id_order(sqlite_url):
    """Why SQLite needs no transaction order (its records carry ``xact_id`` 0): a second writer waits for
    the first one's commit before it takes an id, so ids commit in order and the cursor passes nothing."""
    engine = create_engine(sqlite_url)
    sessionmaker = create_sessionmaker(engine)
    async with sessionmaker() as slow:
        await slow.execute(insert(UsageRecord).values(event("slow_a").to_row()))
        fast = asyncio.create_task(insert_usage(sessionmaker, [event("fast_b")]))
        await asyncio.sleep(0.3)
        assert not fast.done()  # waits for slow's write lock (busy_timeout)
        assert (await export_requests(sessionmaker)).data == []
        await slow.commit()
    await fast
    page = await export_requests(sessionmaker)
    assert [row["request_id"] for row in page.data] == ["slow_a", "fast_b"] and page.next_cursor == "2"
    await engine.dispose()


async def test_a_record_the_database_refuses_does_not_block_the_others(pg_url, tmp_path: Path):
    engine = create_engine(pg_url)
    sessionmaker = create_sessionmaker(engine)
    writer = UsageWriter(sessionmaker, UsageSpool(tmp_path / "spool.jsonl"))
    writer.submit(event("good-1", model="m" * 500))  # over the column's length: truncated, stored
    writer.submit(event("poison", prompt_tokens=2**40))  # out of int4 range: PostgreSQL refuses it
    writer.submit(event("good-2"))
    await writer.flush()
    assert await count(sessionmaker) == 2 and writer.spool.depth() == 0
    assert [e.request_id for e in writer.rejected.read()] == ["poison"]
    await engine.dispose()


def test_migration_0003_freezes_the_rows_recorded_before_it(tmp_path: Path):
    """Rows from before 0003 get their tenant's prices of that moment (defaults where none or gone),
    its name and an outcome, so that later price changes no longer re-price them."""
    from migrations import upgrade_database
    from tests.migrations.test_migrations_schema import execute

    url = f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"
    upgrade_database(url, "0002")
    row = (
        "INSERT INTO usage_records (request_id, tenant_id, model, endpoint, status, prompt_tokens,"
        " cached_tokens, cached_l1_tokens, cached_l2_tokens, cached_l3_tokens, cached_remote_tokens,"
        " completion_tokens, prefill_ms, saved_prefill_ms, created_at, created_hour) VALUES"
    )
    execute(
        url,
        "INSERT INTO tenants (id, name, isolation, reserved_blocks, canonicalization, share_hot_prefixes,"
        " epoch, price_output_per_mtok, created_at, updated_at) VALUES ('tn_1', 'kept', 'namespace', 0,"
        " 'report', 0, 0, 5.0, '2026-01-01 00:00:00', '2026-01-01 00:00:00')",
        f"{row} ('r1', 'tn_1', 'm', 'completions', 200, 1000000, 400000, 0, 0, 0, 0, 100000, 0, 0,"
        " '2026-01-01 00:00:00', 0)",
        f"{row} ('r2', 'tn_gone', 'm', 'completions', 499, 10, 0, 0, 0, 0, 0, 0, 0, 0,"
        " '2026-01-01 00:00:00', 0)",
    )
    upgrade_database(url)
    rows = execute(
        url,
        "SELECT request_id, tenant_name, outcome, price_input_per_mtok, price_output_per_mtok,"
        " cost_uncached_input, cost_cached_input, cost_output, cost_total FROM usage_records"
        " ORDER BY request_id",
    )
    assert [tuple(r) for r in rows] == [
        ("r1", "kept", "completed", 1.0, 5.0, 0.6, 0.04, 0.5, pytest.approx(1.14)),
        ("r2", None, "client_cancelled", 1.0, 2.0, 0.00001, 0.0, 0.0, 0.00001),
    ]


def test_a_record_not_billable_keeps_its_tokens_at_no_cost_through_the_spool(tmp_path: Path):
    """format_error: the tokens the worker used, nothing delivered, nothing billed; a line spooled by an
    earlier version (no ``billable``) is billable."""
    prices = Prices(input_per_mtok=3.0, cached_input_per_mtok=0.5, output_per_mtok=7.0)
    spool = UsageSpool(tmp_path / "spool.jsonl")
    spool.append([event("unbilled", outcome="format_error", status=500, prices=prices, billable=False)])
    earlier = event("earlier", prices=prices).to_json()
    del earlier["billable"]
    with open(spool.path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(earlier) + "\n")
    unbilled, billed = spool.read()
    row = unbilled.to_row()
    assert (row["prompt_tokens"], row["completion_tokens"], row["cost_total"]) == (100, 10, 0.0)
    assert billed.billable and billed.to_row()["cost_total"] > 0


def _report_cursor(values: list) -> str:
    return base64.urlsafe_b64encode(json.dumps(values).encode()).decode()


async def test_a_tampered_cursor_is_refused_not_sent_to_the_database(db_url):
    """A report cursor is base64 JSON the client can forge: strings a driver cannot send (a NUL, which
    PostgreSQL text refuses; a lone surrogate, which does not encode to UTF-8) or longer than their
    column are refused before the query (they were a 500, review r6 #4). The export cursor is ASCII
    digits only (``int`` also took ``+5``, ``1_000`` and full-width digits)."""
    engine = create_engine(db_url)
    sessionmaker = create_sessionmaker(engine)
    await insert_usage(sessionmaker, [event("r1", prices=DEFAULTS)])
    good = [1, "tn_a", "m", 1, "key_1", 1, "user"]
    for bad in (
        [1, "\u0000", "m", 0, "", 0, ""],
        [1, "tn_a", "\ud800", 0, "", 0, ""],
        [1, "tn_a", "m", 1, "\ud800key", 0, ""],
        [1, "tn_a", "m", 0, "", 1, "u\u0000"],
        [1, "t" * 41, "m", 0, "", 0, ""],
        [1, "tn_a", "m" * 201, 0, "", 0, ""],
        [1, "tn_a", "m", 1, "k" * 41, 0, ""],
        [1, "tn_a", "m", 0, "", 1, "u" * 201],
    ):
        with pytest.raises(ValueError):
            await usage_report_page(sessionmaker, by_end_user=True, cursor=_report_cursor(bad), limit=3)
    page = await usage_report_page(sessionmaker, by_end_user=True, cursor=_report_cursor(good), limit=3)
    assert [row.tenant_id for row in page.rows] == ["tn_a"]  # a well-formed cursor still works
    for bad in (
        "+5",
        "1_000",
        "\uff15",
        " 5",
        "5 ",
        "-0",
        "0x5",
        "\u0665",
        "9" * 5000,
        "1.",
        ".1",
        "1.2.3",
        "+1.2",
    ):
        with pytest.raises(ValueError):
            parse_cursor(bad)
        with pytest.raises(ValueError):
            await export_requests(sessionmaker, cursor=bad)
    assert parse_cursor("0") == (0, 0) and parse_cursor("9223372036854775807") == (0, 2**63 - 1)
    assert parse_cursor("12.7") == (12, 7)
    await engine.dispose()


async def test_report_pages_follow_a_cursor_and_totals_cover_the_whole_report(db_url):
    """The report was one unbounded answer (a row per end user per hour: 100,000 users, 56 MB). Pages
    follow a cursor over the row order (keys that are NULL or empty included) and miss or repeat no
    row; the totals are the whole report's, whichever page they come with."""
    engine = create_engine(db_url)
    sessionmaker = create_sessionmaker(engine)
    hour = datetime(2026, 3, 1, 10, 30, tzinfo=UTC)
    users = [None, "", *(f"u{i:02d}" for i in range(9))]
    await insert_usage(
        sessionmaker,
        [
            event(
                f"p{i}",
                key_id=(None, "key_1")[i % 2],
                end_user=users[i % len(users)],
                created_at=hour + timedelta(hours=i % 2),
                prices=DEFAULTS,
            )
            for i in range(40)
        ],
    )
    whole = await usage_report(sessionmaker, granularity="hour", by_end_user=True)
    assert len(whole) > 20
    pages, cursor = [], None
    while True:
        page = await usage_report_page(
            sessionmaker, granularity="hour", by_end_user=True, cursor=cursor, limit=3
        )
        pages.append(page)
        if not page.has_more:
            break
        cursor = page.next_cursor
    assert [row for page in pages for row in page.rows] == whole
    assert all(len(page.rows) == 3 for page in pages[:-1]) and pages[-1].next_cursor is None
    totals = await usage_totals(sessionmaker)
    assert totals == pytest.approx(report_totals(whole)) and totals["requests"] == 40
    with pytest.raises(ValueError):  # a cursor of the other grouping is not one of this report's
        await usage_report_page(sessionmaker, cursor=pages[0].next_cursor, limit=3)
    for bad in ("abc", "WzFd", "W251bGxd"):
        with pytest.raises(ValueError):
            await usage_report_page(sessionmaker, by_end_user=True, cursor=bad, limit=3)
    await engine.dispose()


async def test_unbilled_records_are_stored_and_told_apart_in_report_and_export(db_url):
    """``billable`` was only in the spool: a format_error record's tokens (kept at cost 0) reached the
    table, report and export like billed ones, and billing could not tell them apart."""
    engine = create_engine(db_url)
    sessionmaker = create_sessionmaker(engine)
    prices = Prices(input_per_mtok=3.0, cached_input_per_mtok=0.5, output_per_mtok=7.0)
    await insert_usage(
        sessionmaker,
        [
            event("billed", prices=prices),
            event("unbilled", outcome="format_error", status=500, prices=prices, billable=False),
        ],
    )
    async with sessionmaker() as session:
        stored = dict((await session.execute(select(UsageRecord.request_id, UsageRecord.billable))).all())
    assert stored == {"billed": True, "unbilled": False}
    exported = {row["request_id"]: row for row in (await export_requests(sessionmaker)).data}
    assert (exported["billed"]["billable"], exported["unbilled"]["billable"]) == (True, False)
    assert exported["unbilled"]["prompt_tokens"] == 100 and exported["unbilled"]["cost_total"] == 0.0
    [row] = await usage_report(sessionmaker)
    assert (row.requests, row.unbilled_requests) == (2, 1)
    assert (row.prompt_tokens, row.unbilled_prompt_tokens) == (200, 100)
    assert (row.completion_tokens, row.unbilled_completion_tokens) == (20, 10)
    assert row.cost_total == pytest.approx(event("x", prices=prices).cost.total)
    totals = await usage_totals(sessionmaker)
    assert totals == pytest.approx(report_totals([row]))
    assert (totals["unbilled_requests"], totals["unbilled_prompt_tokens"]) == (1, 100)
    header = report_to_csv([row]).splitlines()[0].split(",")
    assert {"unbilled_requests", "unbilled_prompt_tokens", "unbilled_completion_tokens"} <= set(header)
    await engine.dispose()
