"""Database engines and sessions (SQLite through aiosqlite by default, PostgreSQL through asyncpg)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")  # readers (other gateway processes) never block the writer
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


SQLITE_FILE_MODE = 0o600  # tenant keys' hashes, usage and audit rows: the owner only


def _private_sqlite_file(url: str) -> None:
    """Create the SQLite file owner-only (or tighten an existing one) before SQLite opens it; SQLite
    gives its -wal and -shm files the database file's mode."""
    database = make_url(url).database
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    path = Path(database)
    if not path.parent.is_dir():  # an unreachable database stays unreachable (usage spools meanwhile)
        return
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, SQLITE_FILE_MODE))
    for file in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if file.exists():
            file.chmod(SQLITE_FILE_MODE)


def create_engine(url: str, **kwargs: Any) -> AsyncEngine:
    """An async engine for ``url``; SQLite gets foreign keys, WAL and a busy timeout on every connection,
    and its file is owner-only (0600)."""
    if is_sqlite(url):
        _private_sqlite_file(url)
        engine = create_async_engine(url, **kwargs)
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("pool_size", 5)
    return create_async_engine(url, **kwargs)


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)
