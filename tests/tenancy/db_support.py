"""Database fixtures shared by the tenancy, migrations and gateway tests.

SQLite: one migrated template file per session, copied for every test. PostgreSQL: a fresh database
per session (created and dropped here), its tables truncated before every test that uses it.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from migrations import upgrade_database

POSTGRES_ENV = "PREFIXGATE_TEST_POSTGRES_URL"
REDIS_ENV = "PREFIXGATE_TEST_REDIS_URL"
TABLES = ("usage_records", "api_keys", "audit_log", "tenants", "hot_prefixes")


def service_url(env_name: str, what: str) -> str:
    """The service URL from the environment; skip (or fail under PREFIXGATE_REQUIRE_SERVICES=1) if unset."""
    url = os.environ.get(env_name)
    if url:
        return url
    message = f"{env_name} is not set: no {what} to test against"
    if os.environ.get("PREFIXGATE_REQUIRE_SERVICES") == "1":
        pytest.fail(message + " (PREFIXGATE_REQUIRE_SERVICES=1)")
    pytest.skip(message)


async def _pg_admin(url: str, statement: str) -> None:
    import asyncpg

    parsed = make_url(url).set(drivername="postgresql")
    conn = await asyncpg.connect(parsed.render_as_string(hide_password=False))
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("db-template") / "template.db"
    upgrade_database(f"sqlite+aiosqlite:///{path}")
    return path


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    path = tmp_path / "prefixgate.db"
    shutil.copy(sqlite_template, path)
    return f"sqlite+aiosqlite:///{path}"


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    base = service_url(POSTGRES_ENV, "PostgreSQL")
    name = f"prefixgate_test_{secrets.token_hex(4)}"
    asyncio.run(_pg_admin(base, f'CREATE DATABASE "{name}"'))
    url = make_url(base).set(database=name).render_as_string(hide_password=False)
    try:
        upgrade_database(url)
        yield url
    finally:
        asyncio.run(_pg_admin(base, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def pg_url(pg_database: str) -> str:
    asyncio.run(_pg_admin(pg_database, f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY"))
    return pg_database


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> str:
    """Both backends: the same test runs on SQLite and on PostgreSQL."""
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")
