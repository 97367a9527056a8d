"""KV events: what the worker's prefix cache gained and lost, for the gateways' routing index.

The shape follows vLLM's KV events (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``) with two
additions: every event names its tier (``medium``: ``L1`` device pool, ``L2`` host DRAM, ``L3`` disk,
``remote`` the Redis tier shared by workers) and the namespace id of the stored block, so a gateway index
can never mix namespaces. Disk events include the files found at start-up (a restarted worker announces
what its disk holds); ``remote`` events say what this worker wrote to, evicted from or purged in the
shared Redis, and the gateway credits them to every worker reporting the same ``remote_tier`` id. Events carry
consecutive sequence numbers; a consumer asks for everything after the last one it applied
(``GET /v1/kv_events?since=N``) and so replays what it missed while disconnected. The log is a bounded
ring: a consumer that fell further behind than the ring (or that connects first after the ring lost
its oldest events, e.g. to a large disk announced at start-up) gets ``reset: true`` and a *snapshot*
instead: the blocks the worker holds now, per tier and namespaced, as ``BlockStored`` events in pages,
frozen at one sequence number. It drops what it knew of the worker, applies the pages, and then
continues with the events after that number (a state transfer; docs/routing.md has the protocol).

The state of a tier that loses blocks silently is bounded (``KVEventLog.bound``): Redis expires a block
by TTL and another worker's write may evict it without this worker hearing of it, so the ``remote`` state
keeps a block only until its TTL has passed since this worker last announced it, and a snapshot sends no
more blocks than the Redis budget holds (the least recently announced go first; between snapshots the
state may hold twice that: one write announces its blocks before the evictions it caused). The gateway
bounds its own record of a Redis tier the same way (``gateway.kv_index``); no event is sent for what the
bound drops.

Written by the engine thread, read by the HTTP handlers: a lock guards the ring and the state.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from policies.hashing import BlockHash

BLOCK_STORED = "BlockStored"
BLOCK_REMOVED = "BlockRemoved"
ALL_BLOCKS_CLEARED = "AllBlocksCleared"


@dataclass(frozen=True, kw_only=True, slots=True)
class KVEvent:
    seq: int  # consecutive from 1 for one worker process
    kind: str  # BLOCK_STORED | BLOCK_REMOVED | ALL_BLOCKS_CLEARED
    medium: str  # tier: "L1" | "L2" | "L3" | "remote"
    block_hash: BlockHash | None = None  # None for ALL_BLOCKS_CLEARED
    parent_hash: BlockHash | None = None  # stored blocks only (None: first block of a chain)
    namespace_id: str = ""  # stored blocks only

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"seq": self.seq, "type": self.kind, "medium": self.medium}
        if self.block_hash is not None:
            body["block_hashes"] = [self.block_hash.hex()]
        if self.kind == BLOCK_STORED:
            body["parent_block_hash"] = None if self.parent_hash is None else self.parent_hash.hex()
            body["namespace_id"] = self.namespace_id
        return body


@dataclass(frozen=True, kw_only=True, slots=True)
class StateBound:
    ttl_s: float  # a block not announced again for this long has left the tier
    max_blocks: int  # the tier holds no more: the least recently announced beyond it have left


@dataclass(frozen=True, kw_only=True, slots=True)
class SnapshotPage:
    seq: int  # the state is as of this event: continue with ``since=seq`` after the last page
    events: list[dict[str, Any]]  # BlockStored events (no ``seq``): chains of one tier and namespace
    next_cursor: str | None  # ask for ``snapshot=<next_cursor>`` next; None: this was the last page
    num_blocks: int  # blocks in the whole snapshot

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "next": self.next_cursor, "num_blocks": self.num_blocks}


@dataclass(frozen=True, kw_only=True, slots=True)
class KVEventBatch:
    events: list[KVEvent]
    last_seq: int  # the newest sequence number the worker has issued
    reset: bool  # the consumer missed events that are gone from the ring: drop this worker's index
    snapshot: SnapshotPage | None = None  # set by ``read`` when the consumer needs the state instead


@dataclass(slots=True)
class _Snapshot:
    seq: int  # the log's last sequence number when the state was copied
    blocks: list[tuple[str, BlockHash, BlockHash | None, str]]  # (medium, hash, parent, namespace id)
    used_s: float = field(default_factory=time.monotonic)  # last page served (expiry)
    readers: int = 1  # consumers handed this snapshot (it is shared while no event came after it)
    finished: int = 0  # last pages served: dropped once every reader has read its last page


# A snapshot unread this long is dropped (a consumer asking for it later starts a new one); at most
# this many are kept (each holds references to the blocks' hashes, not copies). A snapshot paged within
# SNAPSHOT_ACTIVE_S is never evicted for a new one: at the cap with every snapshot in use, a consumer
# needing one shares the newest (older than the log, so it may need another after it; never a refusal).
SNAPSHOT_TTL_S = 120.0
# A bounded tier's state holds up to this many times its size between snapshots (``KVEventLog.bound``).
STATE_SLACK = 2
SNAPSHOT_ACTIVE_S = 15.0
MAX_SNAPSHOTS = 4


class KVEventLog:
    """A bounded, thread-safe ring of KV events with consecutive sequence numbers, plus the state the
    events add up to (every block held, per tier), from which a consumer that fell behind the ring is
    sent a snapshot."""

    def __init__(
        self, capacity_events: int = 1 << 17, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._events: deque[KVEvent] = deque(maxlen=capacity_events)
        self._last_seq = 0
        self._lock = threading.Lock()
        # medium -> block hash -> (parent hash, namespace id): what the events so far add up to
        self._state: dict[str, dict[BlockHash, tuple[BlockHash | None, str]]] = {}
        self._snapshots: OrderedDict[str, _Snapshot] = OrderedDict()
        self._clock = clock
        self._bounds: dict[str, StateBound] = {}  # medium -> how long and how much of its state is kept
        # bounded medium -> block hash -> when it was last announced stored, least recent first
        self._announced_s: dict[str, OrderedDict[BlockHash, float]] = {}

    def bound(self, medium: str, *, ttl_s: float, max_blocks: int) -> None:
        """Keep ``medium``'s blocks in the state (what snapshots send) only ``ttl_s`` after their last
        ``stored`` event, and at most ``max_blocks`` of them: for a tier that drops blocks unannounced.

        Called again (a tier's size changes with every dedicated grant), it only stores the new bound
        and trims: the blocks are in ``_announced_s`` since the first call, which is the only one that
        walks the state (blocks held before it count as announced then).
        """
        with self._lock:
            self._bounds[medium] = StateBound(ttl_s=ttl_s, max_blocks=max(0, max_blocks))
            if medium not in self._announced_s:
                now = self._clock()
                self._announced_s[medium] = OrderedDict.fromkeys(self._state.get(medium, {}), now)
            self._trim(medium, slack=STATE_SLACK)

    def _trim(self, medium: str, *, slack: int = 1) -> None:
        """Drop what a bounded medium's state holds past its TTL or beyond ``slack`` times its size, the
        least recently announced first (under the lock)."""
        bound, announced = self._bounds[medium], self._announced_s[medium]
        blocks = self._state.get(medium, {})
        expired_before, max_blocks = self._clock() - bound.ttl_s, slack * bound.max_blocks
        while announced:
            block_hash, announced_s = next(iter(announced.items()))
            if len(announced) <= max_blocks and announced_s > expired_before:
                return
            del announced[block_hash]
            blocks.pop(block_hash, None)

    @property
    def last_seq(self) -> int:
        return self._last_seq

    def _append(self, kind: str, medium: str, **fields: Any) -> None:
        with self._lock:
            self._append_locked(kind, medium, **fields)

    def _append_locked(self, kind: str, medium: str, **fields: Any) -> None:
        self._last_seq += 1
        self._events.append(KVEvent(seq=self._last_seq, kind=kind, medium=medium, **fields))
        blocks = self._state.setdefault(medium, {})
        announced = self._announced_s.get(medium)
        if kind == BLOCK_STORED:
            blocks[fields["block_hash"]] = (fields["parent_hash"], fields["namespace_id"])
            if announced is not None:
                announced[fields["block_hash"]] = self._clock()
                announced.move_to_end(fields["block_hash"])
        elif kind == BLOCK_REMOVED:
            blocks.pop(fields["block_hash"], None)
            if announced is not None:
                announced.pop(fields["block_hash"], None)
        else:
            blocks.clear()
            if announced is not None:
                announced.clear()
        if announced is not None:
            self._trim(medium, slack=STATE_SLACK)

    def stored(
        self, medium: str, block_hash: BlockHash, parent_hash: BlockHash | None, namespace_id: str
    ) -> None:
        self._append(
            BLOCK_STORED, medium, block_hash=block_hash, parent_hash=parent_hash, namespace_id=namespace_id
        )

    def removed(self, medium: str, block_hash: BlockHash) -> None:
        self._append(BLOCK_REMOVED, medium, block_hash=block_hash)

    def cleared(self, medium: str) -> None:
        self._append(ALL_BLOCKS_CLEARED, medium)

    def now(self) -> float:
        """The log's clock: take it before a read whose misses go to ``missed``."""
        return self._clock()

    def missed(self, medium: str, block_hashes: Iterable[BlockHash], *, read_at: float) -> int:
        """A read that began at ``read_at`` (``now()``) found these blocks gone: announce removed those
        ``medium``'s state holds, unless announced stored since (stored again while the read ran; a
        medium without a bound keeps no times: every held one goes). Returns how many were removed."""
        with self._lock:
            held, announced = self._state.get(medium, {}), self._announced_s.get(medium, {})
            gone = [h for h in block_hashes if h in held and announced.get(h, -math.inf) < read_at]
            for block_hash in gone:
                self._append_locked(BLOCK_REMOVED, medium, block_hash=block_hash)
        return len(gone)

    def since(self, seq: int, *, max_events: int = 4096) -> KVEventBatch:
        """Events with a sequence number above ``seq`` (at most ``max_events``, oldest first)."""
        with self._lock:
            last = self._last_seq
            if seq > last:  # the consumer knows a newer log: this worker restarted under the same id
                return KVEventBatch(events=[], last_seq=last, reset=True)
            first = self._events[0].seq if self._events else last + 1
            reset = seq + 1 < first
            start = max(0, seq + 1 - first)
            events = [self._events[i] for i in range(start, min(len(self._events), start + max_events))]
        return KVEventBatch(events=events, last_seq=last, reset=reset)

    def read(self, seq: int, *, cursor: str | None = None, max_events: int = 4096) -> KVEventBatch:
        """What a consumer that applied everything up to ``seq`` needs next: the events after it, or,
        when they are gone from the ring, a snapshot's first page (``reset``); with ``cursor`` (from the
        previous page) the next page of that snapshot (a new snapshot if it expired)."""
        if cursor is not None:
            page = self._page(cursor, max_events)
            if page is not None:
                return KVEventBatch(events=[], last_seq=self._last_seq, reset=False, snapshot=page)
        batch = self.since(seq, max_events=max_events) if cursor is None else None
        if batch is not None and not batch.reset:
            return batch
        page = self._page(self._start_snapshot() + ":0", max_events)
        assert page is not None
        return KVEventBatch(events=[], last_seq=self._last_seq, reset=True, snapshot=page)

    def _start_snapshot(self) -> str:
        """A snapshot for a consumer that needs the state: the newest one when no event came after it
        (shared, no copy), else a new one, freezing the state (a copy of each tier's dict under the lock:
        fast, no new records). Never evicts a snapshot paged within ``SNAPSHOT_ACTIVE_S``: at the cap
        with all of them in use, the newest is shared even though it is older than the log."""
        with self._lock:
            shared = self._share(min_seq=self._last_seq)
            if shared is not None:
                return shared
            for medium in self._bounds:  # TTLs pass between events too; a snapshot sends no more than fits
                self._trim(medium)
            seq, frozen = self._last_seq, {medium: dict(blocks) for medium, blocks in self._state.items()}
        blocks = [
            (medium, block_hash, parent, namespace_id)
            for medium, held in frozen.items()
            for block_hash, (parent, namespace_id) in held.items()
        ]
        with self._lock:
            now = time.monotonic()
            for stale in [k for k, snap in self._snapshots.items() if now - snap.used_s > SNAPSHOT_TTL_S]:
                del self._snapshots[stale]
            shared = self._share(min_seq=seq)  # another thread froze the same or a newer state meanwhile
            if shared is not None:
                return shared
            while len(self._snapshots) >= MAX_SNAPSHOTS:
                idle = min(self._snapshots, key=lambda k: self._snapshots[k].used_s)
                if now - self._snapshots[idle].used_s <= SNAPSHOT_ACTIVE_S:
                    shared = self._share(min_seq=0)
                    assert shared is not None
                    return shared
                del self._snapshots[idle]
            snapshot_id = secrets.token_hex(8)
            self._snapshots[snapshot_id] = _Snapshot(seq=seq, blocks=blocks)
        return snapshot_id

    def _share(self, *, min_seq: int) -> str | None:
        """The newest snapshot if it is as of ``min_seq`` or later, one more reader counted (under the
        lock)."""
        newest = max(self._snapshots, key=lambda k: self._snapshots[k].seq, default=None)
        if newest is None or self._snapshots[newest].seq < min_seq:
            return None
        snap = self._snapshots[newest]
        snap.readers += 1
        snap.used_s = time.monotonic()
        return newest

    def _page(self, cursor: str, max_blocks: int) -> SnapshotPage | None:
        snapshot_id, _, raw_offset = cursor.partition(":")
        with self._lock:
            snap = self._snapshots.get(snapshot_id)
            if snap is None or not raw_offset.isdigit():
                return None
            snap.used_s = time.monotonic()
        offset = int(raw_offset)
        chunk = snap.blocks[offset : offset + max(1, max_blocks)]
        end = offset + len(chunk)
        done = end >= len(snap.blocks)
        if done:
            with self._lock:
                snap.finished += 1
                if snap.finished >= snap.readers:
                    self._snapshots.pop(snapshot_id, None)
        return SnapshotPage(
            seq=snap.seq,
            events=_chains(chunk),
            next_cursor=None if done else f"{snapshot_id}:{end}",
            num_blocks=len(snap.blocks),
        )


def _chains(blocks: list[tuple[str, BlockHash, BlockHash | None, str]]) -> list[dict[str, Any]]:
    """Snapshot blocks as vLLM-shaped ``BlockStored`` events: consecutive blocks of one tier and
    namespace whose parents link them become one event (its ``parent_block_hash`` is the first's)."""
    events: list[dict[str, Any]] = []
    last: tuple[str, BlockHash, str] | None = None  # (medium, hash, namespace) of the previous block
    for medium, block_hash, parent, namespace_id in blocks:
        if last is not None and last == (medium, parent, namespace_id):
            events[-1]["block_hashes"].append(block_hash.hex())
        else:
            events.append(
                {
                    "type": BLOCK_STORED,
                    "medium": medium,
                    "block_hashes": [block_hash.hex()],
                    "parent_block_hash": None if parent is None else parent.hex(),
                    "namespace_id": namespace_id,
                }
            )
        last = (medium, block_hash, namespace_id)
    return events


def attach(log: KVEventLog, index: Any, medium: str) -> None:
    """Publish a ``BlockManager``'s cache changes (the device pool or a tier's index) as ``medium``."""
    index.on_cached = lambda block: log.stored(
        medium, block.block_hash, block.parent_hash, block.namespace_id
    )
    index.on_uncached = lambda block: log.removed(medium, block.block_hash)


class TierEvents:
    """One tier's view of the log: what the disk and Redis tiers call when their content changes."""

    def __init__(self, log: KVEventLog, medium: str) -> None:
        self._log = log
        self.medium = medium

    def stored(self, namespace_id: str, records: Iterable[Any]) -> None:
        """Blocks now held (``BlockRecord``s: hash and parent), in chain order."""
        for record in records:
            self._log.stored(self.medium, record.block_hash, record.parent_hash, namespace_id)

    def removed(self, block_hashes: Iterable[BlockHash]) -> None:
        for block_hash in block_hashes:
            self._log.removed(self.medium, block_hash)

    def now(self) -> float:
        return self._log.now()

    def missed(self, block_hashes: Iterable[BlockHash], *, read_at: float) -> int:
        """Blocks a read that began at ``read_at`` found gone (``KVEventLog.missed``)."""
        return self._log.missed(self.medium, block_hashes, read_at=read_at)

    def bound(self, *, ttl_s: float, max_blocks: int) -> None:
        """The tier drops blocks unannounced after ``ttl_s`` or beyond ``max_blocks``
        (``KVEventLog.bound``)."""
        self._log.bound(self.medium, ttl_s=ttl_s, max_blocks=max_blocks)


def engine_capacity(engine: Any) -> dict[str, int]:
    """Blocks each of the worker's own tiers can hold: a gateway remembers no more of this worker."""
    tiers = engine.store.capacity_blocks() if engine.store is not None else {}
    return {"L1": engine.block_manager.num_blocks, **tiers}


def engine_load(engine: Any) -> dict[str, int]:
    """Running sequences and prompt tokens waiting for prefill (read from the HTTP thread: a snapshot
    that may be a step old, retried if the engine thread changes the queue meanwhile)."""
    for _ in range(3):
        try:
            waiting = list(engine.scheduler.waiting)
            running = list(engine.scheduler.running)
            break
        except RuntimeError:  # deque mutated during iteration
            continue
    else:
        waiting, running = [], []
    return {
        "num_running": len(running),
        "num_waiting": len(waiting),
        "queued_prefill_tokens": sum(len(seq.prompt_token_ids) for seq in waiting),
    }
