import asyncio

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from migrations import alembic_config, current_revision, upgrade_database
from tenancy.db import create_engine
from tenancy.models import Base


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


def test_sqlite_upgrade_matches_models_and_downgrades(tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path / 'sub' / 'db.sqlite'}"
    upgrade_database(url)
    assert current_revision(url) == "0001"
    assert schema_diff(url) == []
    upgrade_database(url)  # idempotent
    command.downgrade(alembic_config(url), "base")
    assert current_revision(url) is None


def test_postgres_schema_matches_models(pg_database):
    assert current_revision(pg_database) == "0001"
    assert schema_diff(pg_database) == []


def test_cli_db_upgrade(tmp_path, capsys):
    from gateway.cli import main

    assert main(["db", "upgrade", "--data-dir", str(tmp_path / "data")]) == 0
    assert "latest revision" in capsys.readouterr().out
    assert current_revision(f"sqlite+aiosqlite:///{tmp_path / 'data' / 'prefixgate.db'}") == "0001"
