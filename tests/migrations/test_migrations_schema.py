import asyncio
import secrets
from collections.abc import Iterator

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import text
from sqlalchemy.engine import make_url

from migrations import alembic_config, current_revision, upgrade_database
from tenancy.db import create_engine
from tenancy.models import Base
from tests.tenancy.db_support import POSTGRES_ENV, _pg_admin, service_url

HEAD = "0008"


def schema_diff(url: str) -> list:
    async def run() -> list:
        engine = create_engine(url)
        async with engine.connect() as conn:
            diff = await conn.run_sync(
                lambda sync: compare_metadata(MigrationContext.configure(sync), Base.metadata)
            )
        await engine.dispose()
        return diff

    return asyncio.run(run())


def execute(url: str, *statements: str) -> list:
    async def run() -> list:
        engine = create_engine(url)
        rows = []
        async with engine.begin() as conn:
            for statement in statements:
                result = await conn.execute(text(statement))
                rows = result.all() if result.returns_rows else rows
        await engine.dispose()
        return rows

    return asyncio.run(run())


def test_sqlite_upgrade_matches_models_and_downgrades(tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path / 'sub' / 'db.sqlite'}"
    upgrade_database(url)
    assert current_revision(url) == HEAD
    assert schema_diff(url) == []
    upgrade_database(url)  # idempotent
    command.downgrade(alembic_config(url), "base")
    assert current_revision(url) is None


def test_0002_keeps_existing_tenants_and_keys_both_ways(tmp_path):
    """Tenants made before 0002 get the canonicalization defaults; going down again keeps their keys
    (a batch "move and copy" of `tenants` would cascade-delete them under SQLite's foreign keys)."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"
    upgrade_database(url, "0001")
    execute(
        url,
        "INSERT INTO tenants (id, name, isolation, reserved_blocks, canonicalization, share_hot_prefixes,"
        " epoch, created_at, updated_at) VALUES ('tn_1', 'old', 'namespace', 0, 'report', 0, 0,"
        " '2026-01-01 00:00:00', '2026-01-01 00:00:00')",
        "INSERT INTO api_keys (id, tenant_id, key_hash, key_prefix, created_at)"
        " VALUES ('key_1', 'tn_1', 'h', 'p', '2026-01-01 00:00:00')",
    )
    upgrade_database(url)
    rows = execute(
        url,
        "SELECT canonicalization_patterns, canonicalization_disabled_rules, canonicalization_note_role"
        " FROM tenants",
    )
    assert [tuple(row) for row in rows] == [("{}", "[]", "user")]
    command.downgrade(alembic_config(url), "0001")
    assert current_revision(url) == "0001"
    assert execute(url, "SELECT id FROM api_keys") == [("key_1",)]


def test_postgres_schema_matches_models(pg_database):
    assert current_revision(pg_database) == HEAD
    assert schema_diff(pg_database) == []


def test_cli_db_upgrade(tmp_path, capsys):
    from gateway.cli import main

    assert main(["db", "upgrade", "--data-dir", str(tmp_path / "data")]) == 0
    assert "latest revision" in capsys.readouterr().out
    assert current_revision(f"sqlite+aiosqlite:///{tmp_path / 'data' / 'prefixgate.db'}") == HEAD


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_database(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """A database with no tables yet: SQLite, or a PostgreSQL database of this test's own."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"
        return
    base = service_url(POSTGRES_ENV, "PostgreSQL")
    name = f"prefixgate_test_{secrets.token_hex(4)}"
    asyncio.run(_pg_admin(base, f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(base).set(database=name).render_as_string(hide_password=False)
    finally:
        asyncio.run(_pg_admin(base, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def test_0007_stores_billable_and_marks_the_unbilled_rows_recorded_before_it(empty_database):
    """Rows from before 0007 are billable, but for the ``format_error`` rows that kept the worker's tokens
    at a cost of 0 under non-zero prices (the only ones ``billable=False`` ever wrote); going down keeps
    every row."""
    url = empty_database
    upgrade_database(url, "0006")
    columns = (
        "request_id, tenant_id, model, endpoint, status, outcome, prompt_tokens, cached_tokens,"
        " cached_l1_tokens, cached_l2_tokens, cached_l3_tokens, cached_remote_tokens, completion_tokens,"
        " prefill_ms, saved_prefill_ms, price_input_per_mtok, price_output_per_mtok, cost_total,"
        " created_at, created_hour"
    )
    values = [
        "('paid', 't', 'm', 'completions', 200, 'completed', 10, 0, 0, 0, 0, 0, 5, 0, 0, 1, 2, 0.00002",
        "('unpaid', 't', 'm', 'completions', 500, 'format_error', 10, 0, 0, 0, 0, 0, 5, 0, 0, 1, 2, 0",
        "('cut', 't', 'm', 'completions', 200, 'format_error', 10, 0, 0, 0, 0, 0, 1, 0, 0, 1, 2, 0.000012",
        "('free', 't', 'm', 'completions', 200, 'completed', 10, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0",
    ]
    execute(
        url,
        *(f"INSERT INTO usage_records ({columns}) VALUES {v}, '2026-01-01 00:00:00+00', 0)" for v in values),
    )
    upgrade_database(url)
    rows = execute(url, "SELECT request_id, billable FROM usage_records ORDER BY request_id")
    assert [(r[0], bool(r[1])) for r in rows] == [
        ("cut", True),
        ("free", True),
        ("paid", True),
        ("unpaid", False),
    ]
    command.downgrade(alembic_config(url), "0006")
    assert current_revision(url) == "0006"
    assert len(execute(url, "SELECT request_id FROM usage_records")) == 4
