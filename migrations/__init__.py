"""Alembic environment and versions of prefixgate's database schema.

``upgrade_database(url)`` runs the migrations programmatically (``prefixgate db upgrade``, ``prefixgate
up``, tests). It is synchronous and starts its own event loop: call it through ``asyncio.to_thread`` from
async code.
"""

from __future__ import annotations

from pathlib import Path

MIGRATIONS_DIR = Path(__file__).resolve().parent


def alembic_config(url: str):  # -> alembic.config.Config (imported lazily: no work at import)
    from alembic.config import Config

    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade_database(url: str, revision: str = "head") -> None:
    """Create or upgrade the schema at ``url`` (SQLite files' folders are created)."""
    from alembic import command
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    """The revision the database at ``url`` is at (None when never migrated)."""
    import asyncio

    from alembic.runtime.migration import MigrationContext

    from tenancy.db import create_engine

    async def read() -> str | None:
        engine = create_engine(url)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(
                    lambda sync: MigrationContext.configure(sync).get_current_revision()
                )
        finally:
            await engine.dispose()

    return asyncio.run(read())


async def upgrade_database_async(url: str, revision: str = "head") -> None:
    """``upgrade_database`` from async code (Alembic's async env runs its own loop, in a thread here)."""
    import asyncio

    await asyncio.to_thread(upgrade_database, url, revision)
