"""The gateway's per-worker prefix index, built from the workers' KV events (``worker.kv_events``).

For every worker it keeps which block hashes are cached in which tier, with the namespace each block
was stored under, plus the last load the worker reported. A request's prefix hashes (chained from its
own namespace key, so another tenant's blocks can never match) are looked up block by block from the
first one; the match stops at the first block the worker lacks. A worker that stops answering its
event stream, or restarts, is dropped from the index at once. A consumer that fell behind the worker's
event ring is sent a snapshot of what the worker holds instead (``reset`` and ``snapshot`` in the
batch): the worker's entry is rebuilt from its pages, then follows the events after the snapshot's
sequence number.

Blocks in the Redis tier (``remote`` events) live outside any one worker: they are kept per Redis tier
id, and every worker reporting that id (``remote_tier`` in its event batches) is credited with them at
the ``remote`` weight, until the tier's TTL passes without the block being announced again.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.routing import WorkerLoad

# How much a cached block is worth by tier, relative to one in the device pool: loading from a lower
# tier costs a copy (L2) or a read (L3, Redis), still far cheaper than recomputing the block.
TIER_WEIGHTS: Mapping[str, float] = {"L1": 1.0, "L2": 0.8, "L3": 0.5, "remote": 0.3}
# Write pressure: device-pool blocks a worker stored, decayed with this time constant. A worker that
# writes many new blocks evicts fast, so a new prefix placed there would be gone soonest.
WRITE_PRESSURE_TAU_S = 60.0


@dataclass(slots=True)
class CachedBlock:
    namespace_id: str
    media: set[str] = field(default_factory=set)  # tiers holding the block ("L1", "L2", …)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerLoadReport:
    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefixMatch:
    num_blocks: int  # leading blocks of the request cached on the worker (any tier)
    weighted_blocks: float  # the same, each weighted by its best tier (TIER_WEIGHTS)


@dataclass(slots=True)
class WorkerIndex:
    worker_id: str | None = None  # the worker process the events came from
    last_seq: int = 0  # last event applied (during a snapshot: the snapshot's, to continue from)
    snapshot_cursor: str | None = None  # the next page of a snapshot being applied
    write_pressure_blocks: float = 0.0  # L1 blocks stored, decayed (WRITE_PRESSURE_TAU_S) to pressure_at_s
    pressure_at_s: float = 0.0  # monotonic
    caught_up: bool = False  # reached the worker's newest event once: later stores are new writes
    blocks: dict[bytes, CachedBlock] = field(default_factory=dict)
    load: WorkerLoadReport = field(default_factory=WorkerLoadReport)
    remote_tier: str | None = None  # id of the Redis tier the worker shares with others (if any)


@dataclass(slots=True)
class SharedBlock:
    namespace_id: str
    expires_s: float  # monotonic: the tier's TTL after the last announcement


class PrefixIndex:
    """Block hashes cached per worker url, fed by KV events."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.workers: dict[str, WorkerIndex] = {}
        self.shared: dict[str, dict[bytes, SharedBlock]] = {}  # Redis tier id -> its blocks
        self._clock = clock
        self._waiters: dict[tuple[str, bytes], list[asyncio.Future[bool]]] = {}  # wait_stored

    def drop(self, url: str) -> None:
        """Forget a worker (dead, restarted, or its event stream broke)."""
        self.workers.pop(url, None)
        for (waited_url, block_hash), _ in list(self._waiters.items()):
            if waited_url == url:
                self._wake(url, block_hash, False)

    async def wait_stored(self, url: str, block_hash: bytes, timeout_s: float) -> bool:
        """Wait until the worker at ``url`` announces ``block_hash`` (True), at most ``timeout_s``."""
        state = self.workers.get(url)
        if state is not None and block_hash in state.blocks:
            return True
        if timeout_s <= 0:
            return False
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        waiters = self._waiters.setdefault((url, block_hash), [])
        waiters.append(future)
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            return False
        finally:
            if future in waiters:
                waiters.remove(future)
            if not waiters:
                self._waiters.pop((url, block_hash), None)

    def release(self, url: str, block_hash: bytes) -> None:
        """Stop the waits for ``block_hash`` on ``url`` (False): the request that was to compute it there
        will not (refused, failed or cancelled), so its followers compute it themselves."""
        self._wake(url, block_hash, False)

    def _wake(self, url: str, block_hash: bytes, stored: bool) -> None:
        for future in self._waiters.pop((url, block_hash), []):
            if not future.done():
                future.set_result(stored)

    def position(self, url: str) -> tuple[str | None, int]:
        """(worker id, last applied sequence number) to resume a worker's event stream from."""
        state = self.workers.get(url)
        return (None, 0) if state is None else (state.worker_id, state.last_seq)

    def snapshot_cursor(self, url: str) -> str | None:
        """The next snapshot page to ask the worker for (None: no snapshot under way)."""
        state = self.workers.get(url)
        return None if state is None else state.snapshot_cursor

    def apply(self, url: str, batch: Mapping[str, Any]) -> None:
        """Apply one ``GET /v1/kv_events`` answer of the worker at ``url``."""
        state = self.workers.get(url)
        if state is None or state.worker_id != batch["worker_id"] or batch.get("reset"):
            state = self.workers[url] = WorkerIndex(worker_id=batch["worker_id"])
        tier = batch.get("remote_tier") or {}
        state.remote_tier = tier.get("id")
        snapshot = batch.get("snapshot")
        for event in batch["events"]:
            if event.get("medium") == "remote":
                self._apply_shared(tier, event)
            else:
                self._apply_event(state, event)
                if self._waiters and event["type"] == "BlockStored":
                    for hex_hash in event.get("block_hashes", ()):
                        self._wake(url, bytes.fromhex(hex_hash), True)
            if snapshot is None:
                state.last_seq = event["seq"]
        if snapshot is not None:  # a page of the worker's state as of event snapshot["seq"]
            state.last_seq = int(snapshot["seq"])
            state.snapshot_cursor = snapshot.get("next")
        elif not batch["events"] and batch.get("reset"):
            state.last_seq = batch["last_seq"]
        load = batch.get("load") or {}
        state.load = WorkerLoadReport(
            num_running=int(load.get("num_running", 0)),
            num_waiting=int(load.get("num_waiting", 0)),
            queued_prefill_tokens=int(load.get("queued_prefill_tokens", 0)),
        )
        if state.caught_up:  # a replay of history is not pressure
            stored = sum(
                len(e.get("block_hashes", ()))
                for e in batch["events"]
                if e["type"] == "BlockStored" and e.get("medium", "L1") == "L1"
            )
            state.write_pressure_blocks = self.write_pressure(state) + stored
            state.pressure_at_s = time.monotonic()
        state.caught_up = state.snapshot_cursor is None and state.last_seq >= int(batch.get("last_seq", 0))

    @staticmethod
    def write_pressure(state: WorkerIndex) -> float:
        """The worker's decayed count of device-pool blocks stored, as of now."""
        age_s = time.monotonic() - state.pressure_at_s
        return state.write_pressure_blocks * math.exp(-age_s / WRITE_PRESSURE_TAU_S)

    @staticmethod
    def _apply_event(state: WorkerIndex, event: Mapping[str, Any]) -> None:
        kind, medium = event["type"], event.get("medium", "L1")
        if kind == "AllBlocksCleared":
            for block_hash in [h for h, b in state.blocks.items() if medium in b.media]:
                PrefixIndex._remove(state, block_hash, medium)
            return
        for hex_hash in event.get("block_hashes", ()):
            block_hash = bytes.fromhex(hex_hash)
            if kind == "BlockStored":
                block = state.blocks.get(block_hash)
                if block is None:
                    block = state.blocks[block_hash] = CachedBlock(namespace_id=event["namespace_id"])
                block.media.add(medium)
            elif kind == "BlockRemoved":
                PrefixIndex._remove(state, block_hash, medium)

    def _apply_shared(self, tier: Mapping[str, Any], event: Mapping[str, Any]) -> None:
        if not tier.get("id"):
            return  # not reachable from the worker's tier id: nothing to credit it to
        blocks = self.shared.setdefault(tier["id"], {})
        expires_s = self._clock() + float(tier.get("ttl_s", 3600))
        if event["type"] == "AllBlocksCleared":
            blocks.clear()
        for hex_hash in event.get("block_hashes", ()):
            if event["type"] == "BlockStored":
                blocks[bytes.fromhex(hex_hash)] = SharedBlock(event["namespace_id"], expires_s)
            elif event["type"] == "BlockRemoved":
                blocks.pop(bytes.fromhex(hex_hash), None)

    def _shared_weight(self, state: WorkerIndex, block_hash: bytes, namespace_id: str) -> float:
        block = self.shared.get(state.remote_tier or "", {}).get(block_hash)
        if block is None or block.namespace_id != namespace_id or block.expires_s < self._clock():
            return 0.0
        return TIER_WEIGHTS["remote"]

    @staticmethod
    def _remove(state: WorkerIndex, block_hash: bytes, medium: str) -> None:
        block = state.blocks.get(block_hash)
        if block is not None:
            block.media.discard(medium)
            if not block.media:
                del state.blocks[block_hash]

    def match(self, url: str, hashes: Sequence[bytes], namespace_ids: Sequence[str]) -> PrefixMatch:
        """The longest run of ``hashes`` (block k stored under ``namespace_ids[k]``) cached on ``url``."""
        state = self.workers.get(url)
        num, weighted = 0, 0.0
        if state is not None:
            for block_hash, namespace_id in zip(hashes, namespace_ids, strict=True):
                block = state.blocks.get(block_hash)
                shared = self._shared_weight(state, block_hash, namespace_id)
                own = block is not None and block.namespace_id == namespace_id
                if not own and not shared:
                    break
                num += 1
                weighted += max(shared, *(TIER_WEIGHTS.get(m, 0.0) for m in block.media)) if own else shared
        return PrefixMatch(num_blocks=num, weighted_blocks=weighted)

    def annotate(
        self, candidates: Iterable[WorkerLoad], hashes: Sequence[bytes], namespace_ids: Sequence[str]
    ) -> list[WorkerLoad]:
        """Candidates with their cached prefix and their last reported load filled in."""
        annotated = []
        for worker in candidates:
            found = self.match(worker.url, hashes, namespace_ids)
            state = self.workers.get(worker.url)
            load = state.load if state is not None else WorkerLoadReport()
            pressure = self.write_pressure(state) if state is not None else 0.0
            annotated.append(
                replace(
                    worker,
                    cached_blocks=found.num_blocks,
                    cached_weighted_blocks=found.weighted_blocks,
                    num_running=load.num_running,
                    queued_prefill_tokens=load.queued_prefill_tokens,
                    write_pressure_blocks=pressure,
                )
            )
        return annotated
