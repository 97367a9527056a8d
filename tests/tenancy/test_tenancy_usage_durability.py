"""The usage writer through real faults: a private PostgreSQL stopped, SIGSTOPped (hung, not refusing)
and flapping; a full spool disk (/dev/full); cancellation mid-write. Every record ends in the database
exactly once: 0 lost, 0 duplicates."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select, text

from migrations import upgrade_database_async
from tenancy.db import create_engine, create_sessionmaker
from tenancy.models import UsageRecord
from tenancy.spool import UsageSpool
from tenancy.usage import UsageWriter, insert_usage
from tests.tenancy.private_postgres import PrivatePostgres, private_postgres
from tests.tenancy.test_tenancy_usage import event


@pytest.fixture(scope="module")
def cluster():
    try:
        manager = private_postgres()
        pg = manager.__enter__()
    except LookupError as exc:
        pytest.skip(f"no private PostgreSQL for fault tests: {exc}")
    try:
        asyncio.run(upgrade_database_async(pg.url))
        yield pg
    finally:
        manager.__exit__(None, None, None)


async def _truncate(url: str) -> None:
    engine = create_engine(url)
    async with engine.begin() as conn:
        await conn.execute(text("TRUNCATE usage_records"))
    await engine.dispose()


@pytest.fixture
def pg(cluster: PrivatePostgres):
    cluster.resume()
    if cluster.process is None:
        cluster.start()
    asyncio.run(_truncate(cluster.url))
    yield cluster
    cluster.resume()
    if cluster.process is None:
        cluster.start()


async def stored_ids(url: str) -> list[str]:
    """Request ids in the database; asserts there is no duplicate."""
    engine = create_engine(url)
    async with create_sessionmaker(engine)() as session:
        ids = sorted(await session.scalars(select(UsageRecord.request_id)))
        assert await session.scalar(select(func.count()).select_from(UsageRecord)) == len(set(ids))
    await engine.dispose()
    return ids


async def test_a_hung_database_times_out_spools_and_shuts_down_in_bounded_time(pg, tmp_path: Path):
    engine = create_engine(pg.url)
    spool = UsageSpool(tmp_path / "spool.jsonl")
    writer = UsageWriter(create_sessionmaker(engine), spool, db_timeout_s=0.5)
    writer.submit(event("before"))
    await writer.flush()  # the pool holds a live connection: the hang hits an open socket
    pg.pause()
    try:
        for i in range(5):
            writer.submit(event(f"hung-{i}"))
        started = time.monotonic()
        await asyncio.wait_for(writer.flush(), 10)
        assert time.monotonic() - started < 5
        assert spool.depth() == 5 and writer.pending == 0
        writer.submit(event("at-close"))
        started = time.monotonic()
        await asyncio.wait_for(writer.close(), 10)  # shutdown does not hang on the database either
        assert time.monotonic() - started < 5 and spool.depth() == 6
    finally:
        pg.resume()
    await engine.dispose()

    engine = create_engine(pg.url)  # the next process replays the spool once
    writer = UsageWriter(create_sessionmaker(engine), UsageSpool(spool.path), db_timeout_s=5)
    await writer.flush()
    expected = sorted(["before", "at-close", *(f"hung-{i}" for i in range(5))])
    assert await stored_ids(pg.url) == expected and writer.spool_depth() == 0
    await engine.dispose()


async def test_cancelling_a_flush_spools_its_batch(pg, tmp_path: Path):
    engine = create_engine(pg.url)
    spool = UsageSpool(tmp_path / "spool.jsonl")
    writer = UsageWriter(create_sessionmaker(engine), spool, flush_s=0.05, db_timeout_s=60)
    writer.submit(event("warm"))
    await writer.flush()
    pg.pause()
    try:
        for i in range(3):
            writer.submit(event(f"in-flight-{i}"))
        task = asyncio.create_task(writer.run())
        await asyncio.sleep(0.5)  # the batch is being written to the hung database
        assert writer.pending == 3  # all in the batch being written to the hung database
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        assert [e.request_id for e in spool.read()] == [f"in-flight-{i}" for i in range(3)]
    finally:
        pg.resume()
    await writer.close()  # stored now, or spooled for the next start
    await engine.dispose()
    engine = create_engine(pg.url)
    await UsageWriter(create_sessionmaker(engine), UsageSpool(spool.path)).flush()
    assert await stored_ids(pg.url) == ["in-flight-0", "in-flight-1", "in-flight-2", "warm"]
    await engine.dispose()


async def test_a_flapping_database_loses_and_duplicates_nothing(pg, tmp_path: Path):
    engine = create_engine(pg.url)
    spool = UsageSpool(tmp_path / "spool.jsonl")
    writer = UsageWriter(
        create_sessionmaker(engine), spool, flush_s=0.02, db_timeout_s=1.0, max_backoff_s=0.2
    )
    task = asyncio.create_task(writer.run())
    expected = []
    for round_no in range(3):
        for i in range(40):
            expected.append(f"f{round_no}-{i}")
            writer.submit(event(expected[-1]))
            await asyncio.sleep(0.005)
            if i == 10:
                await asyncio.to_thread(pg.stop)  # refused: connections drop mid-write
            if i == 25:
                await asyncio.to_thread(pg.start)
    for _ in range(200):
        if writer.pending == 0 and writer.spool_depth() == 0:
            break
        await asyncio.sleep(0.05)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await writer.close()
    assert await stored_ids(pg.url) == sorted(expected)
    assert writer.rejected.read() == [] and writer.num_db_failures > 0
    await engine.dispose()


async def test_a_full_spool_disk_never_kills_the_writer(pg, tmp_path: Path, caplog):
    """The database is down and the spool's disk is full (/dev/full: every write fails with ENOSPC)."""
    spool_path = tmp_path / "spool.jsonl"
    spool_path.symlink_to("/dev/full")
    engine = create_engine(pg.url)
    writer = UsageWriter(
        create_sessionmaker(engine), UsageSpool(spool_path), flush_s=0.02, db_timeout_s=1, max_backoff_s=0.1
    )
    await asyncio.to_thread(pg.stop)
    task = asyncio.create_task(writer.run())
    for i in range(20):
        writer.submit(event(f"full-{i}"))
    for _ in range(100):
        if writer.num_spool_failures >= 3:
            break
        await asyncio.sleep(0.05)
    assert not task.done(), "the writer died"
    assert writer.num_spool_failures >= 3 and writer.pending == 20  # kept, retried
    assert "USAGE SPOOL WRITE FAILED" in caplog.text

    spool_path.unlink()  # space is freed: the records reach the spool
    for _ in range(100):
        if writer.pending == 0:
            break
        await asyncio.sleep(0.05)
    assert writer.spool_depth() == 20
    await asyncio.to_thread(pg.start)  # and the database
    for _ in range(200):
        if writer.spool_depth() == 0:
            break
        await asyncio.sleep(0.05)
    assert not task.done()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await writer.close()
    assert await stored_ids(pg.url) == sorted(f"full-{i}" for i in range(20))
    await engine.dispose()


async def test_shutdown_with_database_and_spool_both_gone_logs_the_records(tmp_path: Path, caplog):
    spool_path = tmp_path / "spool.jsonl"
    spool_path.symlink_to("/dev/full")
    engine = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'missing' / 'usage.db'}")
    writer = UsageWriter(create_sessionmaker(engine), UsageSpool(spool_path))
    writer.submit(event("last-one"))
    with caplog.at_level(logging.CRITICAL):
        await writer.close()  # must not raise
    assert "USAGE RECORD NOT STORED" in caplog.text and '"request_id": "last-one"' in caplog.text
    await engine.dispose()


async def test_replay_streams_the_spool_in_bounded_batches(sqlite_url, tmp_path: Path):
    spool = UsageSpool(tmp_path / "spool.jsonl")
    spool.append([event(f"s{i:04d}") for i in range(1200)])
    engine = create_engine(sqlite_url)
    sessionmaker = create_sessionmaker(engine)
    await insert_usage(sessionmaker, [event("s0003")])  # stored before a crash: skipped on replay
    writer = UsageWriter(sessionmaker, spool, replay_batch=500, replay_batches_per_flush=1)
    writer.submit(event("new"))
    await writer.flush()
    assert len(await stored_ids(sqlite_url)) == 500 + 1  # one slice of the spool, and the new record
    assert writer.spool_depth() == 700
    writer.submit(event("appended-during-replay"))
    await writer.flush()
    await writer.flush()
    await writer.flush()
    ids = await stored_ids(sqlite_url)
    assert len(ids) == 1200 + 2 and writer.spool_depth() == 0
    assert not spool.path.exists() or spool.path.stat().st_size == 0
    assert not spool.replay_path.exists()
    await engine.dispose()


async def test_rejected_records_are_retried_and_poison_stays_aside(pg, tmp_path: Path):
    engine = create_engine(pg.url)
    writer = UsageWriter(create_sessionmaker(engine), UsageSpool(tmp_path / "spool.jsonl"))
    writer.submit(event("poison", prompt_tokens=2**40))  # out of int4 range: refused for its content
    writer.submit(event("good"))
    await writer.flush()
    assert [e.request_id for e in writer.rejected.read()] == ["poison"]
    # A record set aside by an earlier version during a flap is fine on retry.
    writer.rejected.append([event("flap-victim")])
    assert await writer.retry_rejected() == (1, 1)
    assert [e.request_id for e in writer.rejected.read()] == ["poison"]
    assert await stored_ids(pg.url) == ["flap-victim", "good"]
    await engine.dispose()
