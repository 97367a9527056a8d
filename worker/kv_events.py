"""KV events: what the worker's prefix cache gained and lost, for the gateways' routing index.

The shape follows vLLM's KV events (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``) with two
additions: every event names its tier (``medium``: ``L1`` device pool, ``L2`` host DRAM, ``L3`` disk,
``remote`` the Redis tier shared by workers) and the namespace id of the stored block, so a gateway index
can never mix namespaces. Disk events include the files found at start-up (a restarted worker announces
what its disk holds); ``remote`` events say what this worker wrote to, evicted from or purged in the
shared Redis, and the gateway credits them to every worker reporting the same ``remote_tier`` id. Events carry
consecutive sequence numbers; a consumer asks for everything after the last one it applied
(``GET /v1/kv_events?since=N``) and so replays what it missed while disconnected. The log is a bounded
ring: a consumer that fell further behind than the ring gets ``reset: true`` and must drop what it
knows of this worker (it then rebuilds from new events).

Written by the engine thread, read by the HTTP handlers: a lock guards the ring.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
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
class KVEventBatch:
    events: list[KVEvent]
    last_seq: int  # the newest sequence number the worker has issued
    reset: bool  # the consumer missed events that are gone from the ring: drop this worker's index


class KVEventLog:
    """A bounded, thread-safe ring of KV events with consecutive sequence numbers."""

    def __init__(self, capacity_events: int = 1 << 17) -> None:
        self._events: deque[KVEvent] = deque(maxlen=capacity_events)
        self._last_seq = 0
        self._lock = threading.Lock()

    @property
    def last_seq(self) -> int:
        return self._last_seq

    def _append(self, kind: str, medium: str, **fields: Any) -> None:
        with self._lock:
            self._last_seq += 1
            self._events.append(KVEvent(seq=self._last_seq, kind=kind, medium=medium, **fields))

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
