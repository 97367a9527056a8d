import asyncio

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import text

from migrations import alembic_config, current_revision, upgrade_database
from tenancy.db import create_engine
from tenancy.models import Base

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
