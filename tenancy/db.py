"""Database engines and sessions (SQLite through aiosqlite by default, PostgreSQL through asyncpg)."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from pathlib import Path
from typing import Any

import aiosqlite
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


class _StoppableOnce(aiosqlite.Connection):
    """aiosqlite's connection, safe to stop more than once.

    aiosqlite queues one stop message per ``stop()`` and its worker thread ends at the first, so a second
    stop's future is never answered. SQLAlchemy stops a connection twice when a call on it is cancelled
    twice (an abandoned usage write, then shutdown): its forced close stops it while its graceful close is
    pending, and the graceful close stops it again, then waits forever, and so does the event loop's
    teardown. Here the stop message is queued once and every caller gets its own future, answered when
    the thread has ended (one future shared by several waiters would be cancelled with any of them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stop_queued = False
        self._thread_ended: asyncio.Future | None = None  # the only stop message's future, never awaited

    def stop(self) -> asyncio.Future | None:
        if not self._stop_queued:
            self._stop_queued = True
            self._thread_ended = super().stop()
        ended = self._thread_ended
        if ended is None or ended.get_loop().is_closed():  # stopped by garbage collection, no loop to answer
            return None
        waiter = ended.get_loop().create_future()
        ended.add_done_callback(lambda _: waiter.done() or waiter.set_result(None))
        return waiter


def _connect_aiosqlite(database: str, *, iter_chunk_size: int = 64, **kwargs: Any) -> aiosqlite.Connection:
    """``aiosqlite.connect`` with a connection that can be stopped twice (see ``_StoppableOnce``)."""
    connection = _StoppableOnce(lambda: sqlite3.connect(database, **kwargs), iter_chunk_size)
    connection._thread.daemon = True  # as SQLAlchemy sets it for its own connections
    return connection


def _aiosqlite_do_connect(dialect: Any, _record: Any, cargs: list[Any], cparams: dict[str, Any]) -> Any:
    return dialect.dbapi.connect(*cargs, async_creator_fn=_connect_aiosqlite, **cparams)


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


# PostgreSQL ends a session of ours left idle inside a transaction this long (a write abandoned past its
# deadline, a bug): an open usage write holds the per-request export back (tenancy.write_order).
IDLE_IN_TRANSACTION = {"idle_in_transaction_session_timeout": "60s"}


def create_engine(url: str, **kwargs: Any) -> AsyncEngine:
    """An async engine for ``url``; SQLite gets foreign keys, WAL and a busy timeout on every connection,
    and its file is owner-only (0600). PostgreSQL (asyncpg) sessions get ``IDLE_IN_TRANSACTION`` unless
    ``connect_args["server_settings"]`` sets it."""
    if is_sqlite(url):
        _private_sqlite_file(url)
        engine = create_async_engine(url, **kwargs)
        if engine.dialect.driver == "aiosqlite":
            event.listen(engine.sync_engine, "do_connect", _aiosqlite_do_connect)
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("pool_size", 5)
    if make_url(url).get_driver_name() == "asyncpg":
        connect_args = dict(kwargs.get("connect_args", {}))
        settings = {**IDLE_IN_TRANSACTION, **connect_args.get("server_settings", {})}
        kwargs["connect_args"] = {**connect_args, "server_settings": settings}
    return create_async_engine(url, **kwargs)


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)
