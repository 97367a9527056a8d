"""Usage records: batched, idempotent writes off the hot path, with a local spool for outages.

The hot path only appends to an in-memory list (``submit``). A background task flushes it every
``flush_s`` (or sooner when ``batch_max`` records wait): first any spooled records, then the new ones,
each insert being ``ON CONFLICT (request_id) DO NOTHING``. When the database is unreachable the batch
goes to the spool file and is replayed when it returns; on shutdown (``close``) whatever is pending is
written to the database or, failing that, to the spool. Only a hard kill can lose the records of the
last ``flush_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from sqlalchemy import text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenancy.models import UsageRecord
from tenancy.spool import UsageSpool
from tenancy.usage_types import UsageEvent

log = logging.getLogger(__name__)

_INSERT_CHUNK = 500


async def insert_usage(sessionmaker: async_sessionmaker[AsyncSession], events: Iterable[UsageEvent]) -> None:
    """Insert records, skipping request ids already present (idempotent)."""
    rows = [event.to_row() for event in events]
    if not rows:
        return
    async with sessionmaker() as session:
        dialect = session.bind.dialect.name if session.bind is not None else "sqlite"
        insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
        for start in range(0, len(rows), _INSERT_CHUNK):
            stmt = insert(UsageRecord).on_conflict_do_nothing(index_elements=["request_id"])
            await session.execute(stmt, rows[start : start + _INSERT_CHUNK])
        await session.commit()


class UsageWriter:
    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        spool: UsageSpool,
        *,
        flush_s: float = 0.5,
        batch_max: int = 512,
    ) -> None:
        self._sessionmaker = sessionmaker
        self.spool = spool
        # Records the database refused (not for being unreachable): kept for an operator, never dropped.
        self.rejected = UsageSpool(spool.path.with_name(spool.path.stem + ".rejected.jsonl"))
        self._flush_s = flush_s
        self._batch_max = batch_max
        self._pending: list[UsageEvent] = []
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self.num_written = 0
        self.num_spooled = 0

    def submit(self, event: UsageEvent) -> None:
        """Hot path: O(1), no I/O."""
        self._pending.append(event)
        if len(self._pending) >= self._batch_max:
            self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def _database_reachable(self) -> bool:
        try:
            async with self._sessionmaker() as session:
                await session.execute(text("SELECT 1"))
            return True
        except Exception:
            return False

    async def _insert(self, events: list[UsageEvent]) -> None:
        """Insert a batch; if it fails while the database answers, one record must be bad (a poison pill
        that would block every later batch): insert one by one and set the bad ones aside, logged."""
        try:
            await insert_usage(self._sessionmaker, events)
        except Exception:
            if not await self._database_reachable():
                raise
            rejected = []
            for event in events:
                try:
                    await insert_usage(self._sessionmaker, [event])
                except Exception as exc:
                    log.error("usage record %s rejected by the database: %s", event.request_id, exc)
                    rejected.append(event)
            await asyncio.to_thread(self.rejected.append, rejected)

    async def flush(self) -> None:
        """Write spooled then pending records; on failure spool the pending ones."""
        async with self._lock:
            batch, self._pending = self._pending, []
            try:
                await self._replay_spool()
                await self._insert(batch)
                self.num_written += len(batch)
            except Exception as exc:
                if batch:
                    log.warning("usage database unreachable, spooling %d record(s): %s", len(batch), exc)
                    await asyncio.to_thread(self.spool.append, batch)
                    self.num_spooled += len(batch)

    async def _replay_spool(self) -> None:
        if self.spool.depth() == 0:
            return
        spooled = await asyncio.to_thread(self.spool.read)
        await self._insert(spooled)
        await asyncio.to_thread(self.spool.clear)
        log.info("replayed %d spooled usage record(s)", len(spooled))

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._flush_s)
            self._wake.clear()
            await self.flush()

    async def close(self) -> None:
        """Final flush; pending records end in the database or in the spool, never nowhere."""
        await self.flush()
