"""Usage records: batched, idempotent writes off the hot path, with a local spool for outages.

The hot path only appends to an in-memory list (``submit``). A background task flushes it every
``flush_s`` (or sooner when ``batch_max`` records wait): first a bounded slice of the spool, then the
new records, each insert being ``ON CONFLICT (request_id) DO NOTHING`` (the request id is the
idempotency key, so a record is stored once however often it is retried).

Every database call has a deadline (``db_timeout_s``): a database that hangs rather than refuses is a
failure like any other. A failed or timed-out batch goes to the spool; after a failure the database is
left alone for a backoff while new batches go straight to the spool. A spool that cannot be written
(disk full) keeps the batch in memory, logs loudly and retries: nothing kills the writer. A flush
cancelled half-way spools its batch. Records the database refuses for their content (not for being
unreachable) are kept in a rejected file, retried every ``rejected_retry_s`` and listed by the admin
API. Only a hard kill can lose the records of the last ``flush_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

from sqlalchemy import exc as sa_exc
from sqlalchemy import text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenancy.models import UsageRecord
from tenancy.spool import UsageSpool
from tenancy.usage_types import UsageEvent

log = logging.getLogger(__name__)

_INSERT_CHUNK = 500
_CANCEL_GRACE_S = 1.0  # how long a cancelled database call may take to release its connection
T = TypeVar("T")


async def insert_usage(sessionmaker: async_sessionmaker[AsyncSession], events: Iterable[UsageEvent]) -> None:
    """Insert records, skipping request ids already present (idempotent). On PostgreSQL the INSERT is its
    transaction's first statement, so the transaction gets its id (the records' ``xact_id``) while it
    holds its lock on ``usage_records``: what the export's bound relies on (``tenancy.write_order``)."""
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


class _InBackoff(Exception):
    """The database failed a moment ago: spool without calling it."""


def _causes(exc: BaseException) -> list[BaseException]:
    """The exception, the driver's original, and what those were raised from."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo and len(seen) < 8:
        item = todo.pop(0)
        if item is None or any(item is s for s in seen):
            continue
        seen.append(item)
        todo += [getattr(item, "orig", None), item.__cause__, item.__context__]
    return seen


def is_content_error(exc: BaseException) -> bool:
    """Whether the database refused a record for its content (it would refuse it again), as opposed to
    being unreachable, slow, starting or restarting (worth retrying: the record goes to the spool)."""
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return False
    if isinstance(exc, sa_exc.DataError | sa_exc.IntegrityError):
        return True
    for cause in _causes(exc):
        sqlstate = getattr(cause, "sqlstate", None)
        if isinstance(sqlstate, str) and sqlstate:
            return sqlstate[:2] in ("22", "23")  # data exception, integrity constraint violation
        if type(cause).__name__ == "DataError":  # asyncpg refusing an argument before sending it
            return True
    # A record our own code cannot turn into a row (before any I/O).
    return isinstance(exc, TypeError | ValueError) and not isinstance(exc, sa_exc.SQLAlchemyError)


class UsageWriter:
    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        spool: UsageSpool,
        *,
        flush_s: float = 0.5,
        batch_max: int = 512,
        db_timeout_s: float = 5.0,
        replay_batch: int = 500,
        replay_batches_per_flush: int = 20,
        rejected_retry_s: float = 300.0,
        max_backoff_s: float = 10.0,
    ) -> None:
        self._sessionmaker = sessionmaker
        self.spool = spool
        # Records the database refused for their content: retried now and then, never dropped.
        self.rejected = UsageSpool(spool.path.with_name(spool.path.stem + ".rejected.jsonl"))
        self._flush_s = flush_s
        self._batch_max = batch_max
        self._db_timeout_s = db_timeout_s
        self._replay_batch = replay_batch
        self._replay_batches_per_flush = replay_batches_per_flush
        self._rejected_retry_s = rejected_retry_s
        self._max_backoff_s = max_backoff_s
        self._pending: list[UsageEvent] = []
        self._num_in_flight = 0  # records of the batch a flush is writing
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._replay_offset = 0  # bytes of the moved-aside spool already stored
        self._backoff_s = 0.0
        self._db_retry_at = 0.0  # monotonic: no database call before this after a failure
        self._abandoned: set[asyncio.Task] = set()  # timed-out calls still stuck on a hung database
        self._next_rejected_retry = time.monotonic() + rejected_retry_s
        self.num_written = 0
        self.num_spooled = 0
        self.num_db_failures = 0
        self.num_spool_failures = 0

    def submit(self, event: UsageEvent) -> None:
        """Hot path: O(1), no I/O."""
        self._pending.append(event)
        if len(self._pending) >= self._batch_max:
            self._wake.set()

    @property
    def pending(self) -> int:
        """Records in memory: waiting, or in the batch being written."""
        return len(self._pending) + self._num_in_flight

    def spool_depth(self) -> int:
        return self.spool.depth(self._replay_offset)

    # --- database calls, each with a deadline ------------------------------------------------------

    async def _call(self, make: Callable[[], Awaitable[T]]) -> T:
        """Run a database call for at most ``db_timeout_s``. A call that overstays is cancelled and left
        behind (its cleanup may itself hang on the dead connection); TimeoutError is raised."""
        if any(not task.done() for task in self._abandoned):
            raise TimeoutError("an earlier database call is still hanging")
        task = asyncio.ensure_future(make())
        try:
            done, _ = await asyncio.wait({task}, timeout=self._db_timeout_s)
        except asyncio.CancelledError:
            # Shutdown: let the call release its connection before the engine is disposed (a driver
            # closing a connection under a disposed pool never finishes), for a bounded time.
            task.cancel()
            await asyncio.wait({task}, timeout=_CANCEL_GRACE_S)
            self._abandon(task)
            raise
        if not done:
            task.cancel()
            self._abandon(task)
            raise TimeoutError(f"database call took more than {self._db_timeout_s} s")
        return task.result()

    def _abandon(self, task: asyncio.Task) -> None:
        self._abandoned.add(task)
        task.add_done_callback(self._abandoned.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning

    def _database_available(self) -> bool:
        return time.monotonic() >= self._db_retry_at

    def _db_failed(self, exc: BaseException) -> None:
        self.num_db_failures += 1
        self._backoff_s = min(max(self._backoff_s * 2, self._flush_s, 0.05), self._max_backoff_s)
        self._db_retry_at = time.monotonic() + self._backoff_s
        log.warning("usage database unavailable (retry in %.1f s): %r", self._backoff_s, exc)

    def _db_ok(self) -> None:
        self._backoff_s = 0.0
        self._db_retry_at = 0.0

    async def _database_reachable(self) -> bool:
        async def probe() -> None:
            async with self._sessionmaker() as session:
                await session.execute(text("SELECT 1"))

        try:
            await self._call(probe)
            return True
        except Exception:
            return False

    async def _insert(self, events: list[UsageEvent]) -> list[UsageEvent]:
        """Insert a batch; returns the records the database refused for their content. When a batch
        fails while the database answers, some record must be bad (a poison pill that would block every
        later batch): the batch is bisected, so that k bad records among n cost about 2·k·log2(n)
        inserts rather than n under the writer's lock, and the refused ones are set aside. Connection
        problems raise (the stored halves are skipped on replay: inserts are idempotent)."""
        if not events:
            return []
        try:
            await self._call(lambda: insert_usage(self._sessionmaker, events))
            return []
        except Exception as exc:
            if not is_content_error(exc) and (len(events) == 1 or not await self._database_reachable()):
                raise
            if len(events) == 1:
                log.error("usage record %s rejected by the database: %s", events[0].request_id, exc)
                return list(events)
        middle = len(events) // 2
        return await self._insert(events[:middle]) + await self._insert(events[middle:])

    # --- spool, which must never kill the writer ---------------------------------------------------

    async def _to_spool(self, events: list[UsageEvent]) -> bool:
        try:
            await asyncio.to_thread(self.spool.append, events)
        except OSError as exc:
            self.num_spool_failures += 1
            log.error(
                "USAGE SPOOL WRITE FAILED (%s): %d record(s) kept in memory and retried; free space at %s",
                exc,
                len(events),
                self.spool.path,
            )
            return False
        self.num_spooled += len(events)
        return True

    async def _set_aside(self, refused: list[UsageEvent]) -> None:
        if refused:
            try:
                await asyncio.to_thread(self.rejected.append, refused)
            except OSError as exc:
                log.error("could not keep %d rejected usage record(s): %s", len(refused), exc)
                self._pending[:0] = refused

    async def _replay_spool(self) -> None:
        """Store a bounded slice of the spool (``replay_batches_per_flush`` batches)."""
        budget = self._replay_batches_per_flush
        while budget > 0 and await asyncio.to_thread(self.spool.start_replay):
            batches = await asyncio.to_thread(
                lambda n=budget: _take(self.spool.replay_batches(self._replay_offset, self._replay_batch), n)
            )
            for batch in batches:
                await self._set_aside(await self._insert(batch.events))
                self._replay_offset = batch.end_offset
                self.spool.consumed(batch.num_lines)
                self.num_written += len(batch.events)
            budget -= len(batches)
            if budget <= 0:
                return  # more next time (or the file ends exactly here: found empty next time)
            await asyncio.to_thread(self.spool.finish_replay)
            self._replay_offset = 0
            log.info("usage spool replayed")

    # --- the flush loop ----------------------------------------------------------------------------

    async def flush(self) -> None:
        """Write a slice of the spool, then the pending records; on failure spool the pending ones."""
        async with self._lock:
            batch, self._pending = self._pending, []
            self._num_in_flight = len(batch)
            stored = False
            try:
                if not self._database_available():
                    raise _InBackoff
                await self._replay_spool()
                await self._set_aside(await self._insert(batch))
                stored = True
                self.num_written += len(batch)
                self._db_ok()
            except asyncio.CancelledError:
                if not stored and batch:
                    self._spool_now(batch)
                raise
            except Exception as exc:
                if not isinstance(exc, _InBackoff):
                    self._db_failed(exc)
                if batch and not await self._to_spool(batch):
                    self._pending[:0] = batch
            finally:
                self._num_in_flight = 0
        await self._retry_rejected_if_due()

    def _spool_now(self, batch: list[UsageEvent]) -> None:
        """Cancelled mid-flush: spool synchronously (an await could be cancelled again)."""
        try:
            self.spool.append(batch)
            self.num_spooled += len(batch)
        except OSError as exc:
            self.num_spool_failures += 1
            log.error("USAGE SPOOL WRITE FAILED on cancellation (%s): keeping %d record(s)", exc, len(batch))
            self._pending[:0] = batch

    async def _retry_rejected_if_due(self) -> None:
        if time.monotonic() >= self._next_rejected_retry:
            self._next_rejected_retry = time.monotonic() + self._rejected_retry_s
            with contextlib.suppress(Exception):
                await self.retry_rejected()

    async def retry_rejected(self) -> tuple[int, int]:
        """Try the rejected records again; returns (stored, still rejected)."""
        async with self._lock:
            records = await asyncio.to_thread(self.rejected.read)
            if not records:
                return 0, 0
            refused = await self._insert(records)
            await asyncio.to_thread(self.rejected.rewrite, refused)
            self.num_written += len(records) - len(refused)
            return len(records) - len(refused), len(refused)

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._flush_s)
            self._wake.clear()
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop billing: log it and keep going
                log.exception("usage writer flush failed; retrying")

    async def close(self) -> None:
        """Final flush; pending records end in the database or in the spool. Never raises: if both are
        gone, the records are logged as JSON (the last place an operator can recover them from)."""
        self._db_ok()  # one last bounded try, even in backoff
        try:
            await self.flush()
        except Exception:
            log.exception("final usage flush failed")
        if self._pending:
            for event in self._pending:
                log.critical("USAGE RECORD NOT STORED: %s", json.dumps(event.to_json()))
            self._pending = []
        stuck = [task for task in self._abandoned if not task.done()]
        for task in stuck:
            task.cancel()
        if stuck:  # released before the engine is disposed, unless the database hangs
            await asyncio.wait(stuck, timeout=_CANCEL_GRACE_S)


def _take(iterator: Iterable[T], count: int) -> list[T]:
    out = []
    for item in iterator:
        out.append(item)
        if len(out) >= count:
            break
    return out
