"""A database that hangs (SIGSTOPped, not refusing) while the gateway serves and stops: tenants are
served, usage goes to the spool within the write deadline, and shutdown does not wait on the database."""

from __future__ import annotations

import asyncio
import sqlite3
import time

import pytest
from sqlalchemy.engine import make_url

from gateway.app import create_app
from gateway.state import USAGE_WRITER
from migrations import upgrade_database_async
from tenancy.db import create_engine, create_sessionmaker
from tenancy.spool import UsageSpool
from tenancy.usage import UsageWriter
from tests.gateway.conftest import create_tenant, make_config
from tests.gateway.test_gateway_e2e import auth, chat_body, unique_system_prompt
from tests.tenancy.private_postgres import private_postgres
from tests.tenancy.test_tenancy_usage_durability import stored_ids


async def end_every_task_left(timeout_s: float = 15) -> None:
    """What the event loop's teardown does: cancel every task still there and wait for them all (it
    waits without a bound)."""
    left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in left:
        task.cancel()
    if left:
        _, pending = await asyncio.wait(left, timeout=timeout_s)
        assert not pending, f"tasks that never end: {pending}"


async def test_hung_database_spools_and_shutdown_is_bounded(aiohttp_client, tmp_path, worker_url):
    try:
        manager = private_postgres()
        pg = manager.__enter__()
    except LookupError as exc:
        pytest.skip(f"no private PostgreSQL for fault tests: {exc}")
    try:
        await upgrade_database_async(pg.url)
        config = make_config(
            pg.url, tmp_path, worker_urls=(worker_url,), usage_db_timeout_s=1.0, policy_refresh_s=0.2
        )
        client = await aiohttp_client(create_app(config))
        key = (await create_tenant(client))["api_key"]
        first = await client.post(
            "/v1/chat/completions", json=chat_body(unique_system_prompt()), headers=auth(key)
        )
        assert first.status == 200
        await client.app[USAGE_WRITER].flush()
        pg.pause()
        try:
            for _ in range(3):  # served from the cached policy snapshot while the database hangs
                body = chat_body(unique_system_prompt())
                response = await asyncio.wait_for(
                    client.post("/v1/chat/completions", json=body, headers=auth(key)), 30
                )
                assert response.status == 200
            writer = client.app[USAGE_WRITER]
            for _ in range(100):  # within the write deadline (1 s) and a backoff, not never
                if writer.pending == 0 and writer.spool_depth() == 3:
                    break
                await asyncio.sleep(0.1)
            assert writer.pending == 0 and writer.spool_depth() == 3
            started = time.monotonic()
            await asyncio.wait_for(client.close(), 30)
            assert time.monotonic() - started < 10
            await end_every_task_left()  # while the database still hangs
        finally:
            pg.resume()
        assert UsageSpool(config.resolved_spool_path).depth() == 3
        assert len(await stored_ids(pg.url)) == 1
    finally:
        manager.__exit__(None, None, None)


async def test_sqlite_write_held_past_its_deadline_neither_hangs_shutdown_nor_loses_the_record(
    aiohttp_client, sqlite_url, tmp_path, worker_url
):
    """Another connection holds SQLite's write lock (BEGIN EXCLUSIVE), so a usage write outlives its
    deadline and is abandoned. Closing the app, and then the event loop (which cancels every task left and
    waits for them), is bounded; the record ends in the database exactly once after the spool's replay.
    Before the fix the abandoned write's connection was stopped twice (aiosqlite's worker thread then
    never answered the second stop), and the loop's teardown waited forever."""
    config = make_config(sqlite_url, tmp_path, worker_urls=(worker_url,), usage_db_timeout_s=0.3)
    client = await aiohttp_client(create_app(config))
    key = (await create_tenant(client))["api_key"]
    writer = client.app[USAGE_WRITER]
    holder = sqlite3.connect(make_url(sqlite_url).database, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # WAL: readers go on, every writer waits (busy_timeout 5 s)
    try:
        response = await client.post(
            "/v1/chat/completions", json=chat_body(unique_system_prompt()), headers=auth(key)
        )
        assert response.status == 200
        request_id = response.headers["x-request-id"]
        for _ in range(100):  # the write is abandoned after 0.3 s and its batch spooled
            if writer.spool_depth() == 1:
                break
            await asyncio.sleep(0.05)
        assert writer.spool_depth() == 1 and writer.pending == 0
        started = time.monotonic()
        await asyncio.wait_for(client.close(), 30)
        assert time.monotonic() - started < 10
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    await end_every_task_left()

    engine = create_engine(sqlite_url)  # the next start replays the spool
    await UsageWriter(create_sessionmaker(engine), UsageSpool(config.resolved_spool_path)).flush()
    await engine.dispose()
    assert request_id in await stored_ids(sqlite_url)  # and only once (stored_ids asserts it)
