"""Which usage records are settled in write order (PostgreSQL): the bound of the per-request export.

A usage record carries ``xact_id``, the 64-bit id of the transaction that wrote it (migration 0008), and
the export hands records out in ``(xact_id, id)`` order. A record may be handed out only once no record
with a lower ``xact_id`` can still appear, or a consumer following the cursor would pass it for good.
``settled_below`` answers that bound: every usage record with ``xact_id`` below it that will ever exist
is visible to any snapshot taken after it returns.

Review r8 #1: the bound was the snapshot's xmin, the oldest transaction running on the whole server, so a
session idle in a transaction in any database (another application, an admin's psql) held every export
back for as long as it stayed open. Only the transactions that can still write usage records matter.

Why the bound holds. The statement reads the lock table after its snapshot is taken. Let T be a
transaction that writes a usage record with ``xact_id`` X below the bound B:

* B is at most the snapshot's xmax, so X was assigned before the snapshot.
* ``xact_id`` is the column default ``pg_current_xact_id()``, evaluated by the INSERT's executor, and the
  INSERT takes its RowExclusiveLock on ``usage_records`` before that (parse analysis, or the cached
  plan's lock acquisition), holding it to the end of the transaction. **Precondition**: a transaction
  writes its usage records before anything else gets it a transaction id (``insert_usage``: a fresh
  transaction whose first statement is the INSERT), so T held the lock from before X was assigned,
  thus from before the snapshot.
* Had T still been running when the lock table was read, its lock and its id would be listed, and B
  would be at most X. So T had ended: a later snapshot (the export's query) sees its records, or it
  rolled back and there are none.

A transaction that holds the lock but has no id yet gets one at or above xmax: the bound never exceeds
xmax. A writer waiting for the lock has no id from its INSERT yet. A transaction that takes an id first
and writes usage records later breaks the precondition: its records could come after the cursor passed.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

_XID_SPAN = 2**32

# One read of the lock table (MATERIALIZED: pg_locks read twice could disagree). A transaction holds an
# ExclusiveLock on each of its own ids (its subtransactions' come later and are higher); joined by
# virtual transaction, prepared transactions (no pid) are found too. Any mode but a plain read's.
_SETTLED_SQL = text(
    """
WITH locks AS MATERIALIZED (
    SELECT locktype, database, relation, mode, virtualtransaction, transactionid FROM pg_locks
)
SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS xmax,
    ARRAY(
        SELECT DISTINCT own.transactionid::text::bigint
        FROM locks AS usage_lock JOIN locks AS own USING (virtualtransaction)
        WHERE usage_lock.locktype = 'relation'
            AND usage_lock.database = (SELECT oid FROM pg_database WHERE datname = current_database())
            AND usage_lock.relation = 'usage_records'::regclass
            AND usage_lock.mode <> 'AccessShareLock'
            AND own.locktype = 'transactionid' AND own.mode = 'ExclusiveLock'
    ) AS writers
"""
)


def widen_xid(xid: int, xmax: int) -> int:
    """The 64-bit id of a running transaction whose 32-bit id is ``xid``, given a snapshot's 64-bit
    ``xmax``: PostgreSQL keeps every running id within 2**31 of the next one, before or after it."""
    delta = (xid - xmax) % _XID_SPAN
    if delta >= _XID_SPAN // 2:
        delta -= _XID_SPAN
    return xmax + delta


async def settled_below(session: AsyncSession) -> int:
    """The ``xact_id`` below which every usage record is settled (see the module's docstring). Run it in
    its own transaction, and the query that relies on it in a later one (READ COMMITTED or a new
    transaction: it needs a snapshot taken after this returns)."""
    row = (await session.execute(_SETTLED_SQL)).one()
    return min([row.xmax, *(widen_xid(xid, row.xmax) for xid in row.writers)])
