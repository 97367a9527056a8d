"""Billing survives a database outage and a gateway restart: spooled, replayed once, none lost."""

import asyncio
import secrets

from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from gateway.app import create_app
from gateway.state import USAGE_WRITER
from migrations import upgrade_database_async
from tenancy.db import create_engine, create_sessionmaker
from tenancy.models import UsageRecord
from tenancy.spool import UsageSpool
from tests.gateway.conftest import create_tenant, make_config
from tests.gateway.test_gateway_e2e import auth, chat, chat_body, unique_system_prompt
from tests.tenancy.db_support import POSTGRES_ENV, _pg_admin, service_url


async def request_ids(url: str) -> list[str]:
    engine = create_engine(url)
    async with create_sessionmaker(engine)() as session:
        ids = list(await session.scalars(select(UsageRecord.request_id)))
        assert await session.scalar(select(func.count()).select_from(UsageRecord)) == len(set(ids))
    await engine.dispose()
    return ids


async def test_outage_spools_and_restart_replays(aiohttp_client, tmp_path, worker_url):
    base = service_url(POSTGRES_ENV, "PostgreSQL")
    name = f"prefixgate_outage_{secrets.token_hex(4)}"
    url = make_url(base).set(database=name).render_as_string(hide_password=False)
    await _pg_admin(base, f'CREATE DATABASE "{name}"')
    try:
        await upgrade_database_async(url)
        config = make_config(url, tmp_path, worker_urls=(worker_url,), usage_flush_s=3600)
        first = await aiohttp_client(create_app(config))
        key = (await create_tenant(first))["api_key"]
        body = chat_body(unique_system_prompt(10))
        await chat(first, key, body)
        await first.app[USAGE_WRITER].flush()
        assert len(await request_ids(url)) == 1

        await _pg_admin(base, f'DROP DATABASE "{name}" WITH (FORCE)')  # the database goes away
        for _ in range(2):  # tenants keep being served from the cached policy snapshot
            await chat(first, key, body)
        await first.app[USAGE_WRITER].flush()
        assert first.app[USAGE_WRITER].spool.depth() == 2
        missing = await first.post("/v1/chat/completions", json={"model": "x"}, headers=auth(key))
        assert missing.status == 400
        await first.close()  # shutdown: the pending record cannot reach the database either
        assert UsageSpool(config.resolved_spool_path).depth() == 3  # the spool (and a replay under way)

        await _pg_admin(base, f'CREATE DATABASE "{name}"')  # the database returns (empty)
        await upgrade_database_async(url)
        second = await aiohttp_client(create_app(config))
        for _ in range(50):
            if second.app[USAGE_WRITER].spool.depth() == 0:
                break
            await second.app[USAGE_WRITER].flush()
            await asyncio.sleep(0.05)
        ids = await request_ids(url)
        assert len(ids) == 3 and second.app[USAGE_WRITER].spool.depth() == 0
        await second.app[USAGE_WRITER].flush()
        assert sorted(await request_ids(url)) == sorted(ids)  # replay is idempotent
    finally:
        await _pg_admin(base, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
