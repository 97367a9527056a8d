"""The per-request export holds records back only for transactions that can still write usage records
(review r8 #1): the oldest open transaction of the whole PostgreSQL server held every page back, even one
idle in another database, and the page then said ``has_more`` false.

The late-commit cases themselves (a record committing after a later one) are in test_tenancy_usage."""

from __future__ import annotations

import asyncio
import contextlib
import random
from datetime import UTC, datetime

import asyncpg
from sqlalchemy import insert, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from tenancy.db import create_engine, create_sessionmaker
from tenancy.models import Tenant, UsageRecord
from tenancy.reports import export_requests
from tenancy.usage import insert_usage
from tenancy.write_order import widen_xid
from tests.tenancy.test_tenancy_usage import event


async def test_an_open_transaction_in_another_database_does_not_hold_the_export_back(pg_url):
    engine = create_engine(pg_url)
    sessionmaker = create_sessionmaker(engine)
    url = make_url(pg_url)
    # Another application on the same server, in another database: nothing to do with usage records.
    other = await asyncpg.connect(
        host=url.host, port=url.port or 5432, user=url.username, password=url.password, database="postgres"
    )
    tx = other.transaction()
    try:
        await tx.start()
        await other.execute("SELECT pg_current_xact_id()")  # what any write does: it takes an id
        await insert_usage(sessionmaker, [event("committed_1"), event("committed_2")])
        page = await export_requests(sessionmaker)
        assert [row["request_id"] for row in page.data] == ["committed_1", "committed_2"]
        assert not page.has_more and not page.held_back
    finally:
        await tx.rollback()
        await other.close()
        await engine.dispose()


async def test_an_open_transaction_that_writes_no_usage_does_not_hold_the_export_back(pg_url):
    """In the same database: an admin's session idle in a transaction that wrote a tenant, say."""
    engine = create_engine(pg_url)
    sessionmaker = create_sessionmaker(engine)
    async with sessionmaker() as session:
        now = datetime.now(UTC)
        session.add(Tenant(id="tn_a", name="a", created_at=now, updated_at=now))
        await session.commit()
    async with sessionmaker() as admin:
        await admin.execute(update(Tenant).where(Tenant.id == "tn_a").values(name="renamed"))
        await admin.execute(text("SELECT pg_current_xact_id()"))  # it has a transaction id
        await insert_usage(sessionmaker, [event("committed")])
        page = await export_requests(sessionmaker)
        assert [row["request_id"] for row in page.data] == ["committed"]
        assert not page.has_more and not page.held_back
        await admin.rollback()
    await engine.dispose()


async def test_a_page_with_records_held_back_says_so(pg_url):
    """A usage write still open holds the later records back: the page says more are waiting (it said
    ``has_more`` false, as if the export were complete) and why none came."""
    engine = create_engine(pg_url)
    sessionmaker = create_sessionmaker(engine)
    await insert_usage(sessionmaker, [event("first")])
    async with sessionmaker() as slow:
        await slow.execute(insert(UsageRecord).values(event("slow").to_row()))
        await insert_usage(sessionmaker, [event("fast")])
        page = await export_requests(sessionmaker)
        assert [row["request_id"] for row in page.data] == ["first"]
        assert page.has_more and page.held_back
        again = await export_requests(sessionmaker, cursor=page.next_cursor)
        assert again.data == [] and again.has_more and again.held_back
        assert again.next_cursor == page.next_cursor
        await slow.commit()
    rest = await export_requests(sessionmaker, cursor=page.next_cursor)
    assert [row["request_id"] for row in rest.data] == ["slow", "fast"]
    assert not rest.has_more and not rest.held_back
    await engine.dispose()


async def test_a_full_page_before_held_back_records_has_more(pg_url):
    engine = create_engine(pg_url)
    sessionmaker = create_sessionmaker(engine)
    await insert_usage(sessionmaker, [event("one"), event("two")])
    async with sessionmaker() as slow:
        await slow.execute(insert(UsageRecord).values(event("slow").to_row()))
        page = await export_requests(sessionmaker, limit=1)
        assert [row["request_id"] for row in page.data] == ["one"] and page.has_more
        page = await export_requests(sessionmaker, cursor=page.next_cursor, limit=1)
        # "two" is not held back (its transaction is older than slow's): nothing else visible waits.
        assert [row["request_id"] for row in page.data] == ["two"] and not page.has_more
        assert not page.held_back
        await slow.rollback()
    await engine.dispose()


async def test_the_gateways_sessions_end_a_transaction_left_idle(pg_url):
    """A usage write of ours left idle (abandoned past its deadline) holds the export back at most this
    long: the server ends the session and rolls it back."""
    engine = create_engine(pg_url)
    async with engine.connect() as connection:
        assert await connection.scalar(text("SHOW idle_in_transaction_session_timeout")) == "1min"
    await engine.dispose()
    settings = {"idle_in_transaction_session_timeout": "1500ms"}
    engine = create_engine(pg_url, connect_args={"server_settings": settings})
    sessionmaker = create_sessionmaker(engine)
    stuck = sessionmaker()
    try:
        await stuck.execute(insert(UsageRecord).values(event("stuck").to_row()))
        await insert_usage(sessionmaker, [event("later")])
        assert (await export_requests(sessionmaker)).held_back
        await asyncio.sleep(3.0)  # the server ends stuck's session after 1.5 s idle
        page = await export_requests(sessionmaker)
        assert [row["request_id"] for row in page.data] == ["later"] and not page.has_more
    finally:
        with contextlib.suppress(DBAPIError):  # its connection is gone
            await stuck.close()
        await engine.dispose()


async def test_a_consumer_following_the_cursor_gets_every_record_once_under_concurrent_writes(pg_url):
    """Several writers flushing at once commit out of id order; a consumer following the cursor all the
    while gets each record exactly once (with the bound at the snapshot's xmax alone, ignoring the open
    usage writes, it lost records in 4 runs of 5). The sleeps are seeded; the interleavings are not."""
    engine = create_engine(pg_url, pool_size=8)
    sessionmaker = create_sessionmaker(engine)
    num_writers, num_batches = 6, 25
    written = {f"w{w}_b{b}_{i}" for w in range(num_writers) for b in range(num_batches) for i in range(3)}
    seen: list[str] = []
    rng = random.Random(16)

    async def write(writer: int) -> None:
        for batch in range(num_batches):  # as insert_usage writes, slow to commit
            async with sessionmaker() as session:
                rows = [event(f"w{writer}_b{batch}_{i}").to_row() for i in range(3)]
                await session.execute(insert(UsageRecord), rows)
                await asyncio.sleep(rng.random() * 0.02)
                await session.commit()

    async def follow(cursor: str | None, stop: asyncio.Event) -> str | None:
        while not stop.is_set():
            page = await export_requests(sessionmaker, cursor=cursor, limit=7)
            seen.extend(row["request_id"] for row in page.data)
            cursor = page.next_cursor
        return cursor

    stop = asyncio.Event()
    follower = asyncio.create_task(follow(None, stop))
    await asyncio.gather(*(write(w) for w in range(num_writers)))
    stop.set()
    cursor = await follower
    while True:  # every writer is done: nothing is held back any more
        page = await export_requests(sessionmaker, cursor=cursor)
        seen.extend(row["request_id"] for row in page.data)
        cursor = page.next_cursor
        if not page.has_more:
            break
    assert len(seen) == len(set(seen)) and set(seen) == written
    await engine.dispose()


def test_a_32_bit_transaction_id_widens_next_to_the_snapshot_xmax():
    epoch = 5 * 2**32
    assert widen_xid(7, epoch + 10) == epoch + 7
    assert widen_xid(2**32 - 5, epoch + 10) == epoch - 5  # taken before the 32-bit counter wrapped
    assert widen_xid(20, epoch + 10) == epoch + 20  # taken after the snapshot
    assert widen_xid(3, 2**32 - 2) == 2**32 + 3  # after a wrap that came after the snapshot
    assert widen_xid(700, 700) == 700
