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
the ``remote`` weight, until the tier's TTL passes without the block being announced again. A worker
names one tier id at a time: when it names another, its old tier's entries are forgotten unless another
worker still names that tier, so the shared entries never outgrow one tier's cap per worker url (a worker
naming a new id per batch used to keep every one). A dropped worker's tier is kept for its url (what it
wrote is still in Redis for a restarted worker or its peers) until that url names another tier, or the
entries expire. The TTL a worker reports is clamped to ``max_remote_ttl_s``.

Memory is bounded. Redis expires blocks silently, so shared entries are kept in the order they were last
announced and swept from the front once their TTL has passed; a tier's entries are capped at
``CAPACITY_SLACK`` times the blocks its budget holds (``remote_tier.capacity_blocks``), the oldest going
first. A worker's own entries are capped the same way by what its tiers hold (``capacity_blocks`` in its
batches: L1, L2, L3), on what each batch nets to (a restarted worker announces the files its disk holds,
then the evictions down to its budget); a worker that announces more (broken or hostile) is refused like
a malformed batch (``ValueError``: the consumer drops it from the index). Without a reported capacity
the caps are ``DEFAULT_MAX_BLOCKS``; a reported one is never trusted beyond ``MAX_BLOCKS``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
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
# Bounds on what the index remembers per worker and per Redis tier (entries are ~200 B each): a reported
# capacity times the slack (events and evictions race; a disk may briefly hold more than its budget), at
# most MAX_BLOCKS; DEFAULT_MAX_BLOCKS when none is reported.
CAPACITY_SLACK = 2
DEFAULT_MAX_BLOCKS = 1 << 18
MAX_BLOCKS = 1 << 22
# A Redis tier's TTL as reported is trusted up to this (the worker's default is 3600 s): an entry announced
# once is forgotten by then at the latest, whatever the worker says.
DEFAULT_MAX_REMOTE_TTL_S = 86400.0
MAX_TIER_ID_CHARS = 128


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
    max_blocks: int = DEFAULT_MAX_BLOCKS  # entries allowed in ``blocks`` (from the reported capacity)


@dataclass(slots=True)
class SharedBlock:
    namespace_id: str
    expires_s: float  # monotonic: the tier's TTL after the last announcement


def capacity_bound(capacity: Any) -> int:
    """How many entries to keep for a reported capacity (blocks per tier, or one number of blocks).

    Raises:
        ValueError: the capacity is not a count of blocks (a malformed batch).
    """
    if capacity is None:
        return DEFAULT_MAX_BLOCKS
    counts = list(capacity.values()) if isinstance(capacity, Mapping) else [capacity]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        raise ValueError(f"capacity_blocks must be counts of blocks, not {capacity!r}")
    return min(MAX_BLOCKS, CAPACITY_SLACK * sum(counts) + 1024)


def _num_removals(events: Sequence[Mapping[str, Any]], max_blocks: int) -> int:
    """Entries a batch's own (non-remote) events may remove: its BlockRemoved hashes, plus a whole entry
    (``max_blocks``, once) when it clears a tier."""
    removals, cleared = 0, False
    for event in events:
        if event.get("medium") == "remote":
            continue
        if event["type"] == "BlockRemoved":
            removals += len(event.get("block_hashes", ()))
        cleared = cleared or event["type"] == "AllBlocksCleared"
    return removals + (max_blocks if cleared else 0)


class PrefixIndex:
    """Block hashes cached per worker url, fed by KV events."""

    def __init__(
        self, clock: Any = time.monotonic, max_remote_ttl_s: float = DEFAULT_MAX_REMOTE_TTL_S
    ) -> None:
        self.workers: dict[str, WorkerIndex] = {}
        self.max_remote_ttl_s = max_remote_ttl_s
        # Redis tier id -> its blocks, oldest announcement first (so expired ones are swept from the front)
        self.shared: dict[str, OrderedDict[bytes, SharedBlock]] = {}
        self._shared_max: dict[str, int] = {}  # Redis tier id -> entries kept at most
        self._dropped_tiers: dict[str, str] = {}  # url of a dropped worker -> the Redis tier id it named
        self._clock = clock
        # (url, block hash) -> (leader's request id, future) of each wait_stored
        self._waiters: dict[tuple[str, bytes], list[tuple[str, asyncio.Future[bool]]]] = {}

    def drop(self, url: str) -> None:
        """Forget a worker (dead, restarted, or its event stream broke). Its Redis tier's entries stay,
        held for its url (at most one tier per url), until the url names another tier or they expire."""
        state = self.workers.pop(url, None)
        if state is not None and state.remote_tier:
            before = self._dropped_tiers.get(url)
            self._dropped_tiers[url] = state.remote_tier
            if before and before != state.remote_tier:
                self._release_tier(before)
        for (waited_url, block_hash), _ in list(self._waiters.items()):
            if waited_url == url:
                self._wake(url, block_hash, False)

    async def wait_stored(self, url: str, block_hash: bytes, timeout_s: float, leader_id: str = "") -> bool:
        """Wait until the worker at ``url`` announces ``block_hash`` (True), at most ``timeout_s``, or
        until ``release`` of the leader ``leader_id`` (the request computing it there) says it will not
        (False)."""
        state = self.workers.get(url)
        if state is not None and block_hash in state.blocks:
            return True
        if timeout_s <= 0:
            return False
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        waiters = self._waiters.setdefault((url, block_hash), [])
        waiter = (leader_id, future)
        waiters.append(waiter)
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            return False
        finally:
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters:
                self._waiters.pop((url, block_hash), None)

    def release(self, url: str, block_hash: bytes, leader_id: str = "", *, stored: bool = False) -> None:
        """Stop the waits of leader ``leader_id``'s followers for ``block_hash`` on ``url``. With ``stored``
        False that request was to compute it there and will not (refused, failed or cancelled), so its
        followers compute it themselves; with True it has (its first token came: ``RequestPipeline.
        prefilled``) and the KV event saying so is still on its way. Followers of another leader placed
        on the same block there (another ``prompt_cache_key``, another tenant's placement) keep waiting
        for theirs. ``leader_id`` "": every wait for the block there."""
        waiters = self._waiters.get((url, block_hash), [])
        for leader, future in list(waiters):
            if (not leader_id or leader == leader_id) and not future.done():
                future.set_result(stored)

    def _wake(self, url: str, block_hash: bytes, stored: bool) -> None:
        for _, future in self._waiters.pop((url, block_hash), []):
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
        old_tier = state.remote_tier if state is not None else self._dropped_tiers.pop(url, None)
        if state is None or state.worker_id != batch["worker_id"] or batch.get("reset"):
            state = self.workers[url] = WorkerIndex(worker_id=batch["worker_id"])
        tier = batch.get("remote_tier") or {}
        state.remote_tier, ttl_s = self._remote_tier_of(tier)
        if old_tier and old_tier != state.remote_tier:  # one tier per worker: the one it named before goes
            self._release_tier(old_tier)
        state.max_blocks = capacity_bound(batch.get("capacity_blocks"))
        self._sweep_shared()
        if state.remote_tier:
            self._shared_max[state.remote_tier] = capacity_bound(tier.get("capacity_blocks"))
        snapshot = batch.get("snapshot")
        # The cap is on what the batch nets to: a worker restarted on a disk fuller than its new budget
        # announces every file found, then the evictions. Meanwhile the entry may grow past the cap by
        # the removals still to come in this batch, no more (a hostile worker gains nothing by them).
        headroom = _num_removals(batch["events"], state.max_blocks)
        for event in batch["events"]:
            if event.get("medium") == "remote":
                self._apply_shared(state.remote_tier, ttl_s, event)
            else:
                self._apply_event(state, event, state.max_blocks + headroom)
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
        if len(state.blocks) > state.max_blocks:
            raise ValueError(f"worker announced more blocks than its tiers hold ({state.max_blocks})")
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
    def _apply_event(state: WorkerIndex, event: Mapping[str, Any], max_blocks: int) -> None:
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
                    if len(state.blocks) >= max_blocks:
                        raise ValueError(
                            f"worker announced more blocks than its tiers hold ({state.max_blocks})"
                        )
                    block = state.blocks[block_hash] = CachedBlock(namespace_id=event["namespace_id"])
                block.media.add(medium)
            elif kind == "BlockRemoved":
                PrefixIndex._remove(state, block_hash, medium)

    def _remote_tier_of(self, tier: Mapping[str, Any]) -> tuple[str | None, float]:
        """(id, TTL clamped to ``max_remote_ttl_s``) of the Redis tier a batch names.

        Raises:
            ValueError: the id is not a short string or the TTL not a number of seconds (a malformed batch).
        """
        tier_id = tier.get("id") or None
        if tier_id is None:
            return None, 0.0
        if not isinstance(tier_id, str) or len(tier_id) > MAX_TIER_ID_CHARS:
            raise ValueError(f"remote_tier.id must be a string of at most {MAX_TIER_ID_CHARS} characters")
        ttl_s = float(tier.get("ttl_s", 3600))
        if not ttl_s >= 0:  # NaN too
            raise ValueError(f"remote_tier.ttl_s must be a number of seconds, not {ttl_s!r}")
        return tier_id, min(ttl_s, self.max_remote_ttl_s)

    def _release_tier(self, tier_id: str) -> None:
        """Forget a Redis tier's entries once no worker (nor a dropped worker's url) names it."""
        named = [state.remote_tier for state in self.workers.values()] + list(self._dropped_tiers.values())
        if tier_id in named:
            return
        self.shared.pop(tier_id, None)
        self._shared_max.pop(tier_id, None)

    def _apply_shared(self, tier_id: str | None, ttl_s: float, event: Mapping[str, Any]) -> None:
        if not tier_id:
            return  # not reachable from the worker's tier id: nothing to credit it to
        blocks = self.shared.setdefault(tier_id, OrderedDict())
        max_blocks = self._shared_max.get(tier_id, DEFAULT_MAX_BLOCKS)
        expires_s = self._clock() + ttl_s
        if event["type"] == "AllBlocksCleared":
            blocks.clear()
        for hex_hash in event.get("block_hashes", ()):
            block_hash = bytes.fromhex(hex_hash)
            if event["type"] == "BlockStored":
                blocks.pop(block_hash, None)  # announced again: it moves to the back (expires last)
                blocks[block_hash] = SharedBlock(event["namespace_id"], expires_s)
                while len(blocks) > max_blocks:  # more than the tier holds: the oldest is gone from it
                    blocks.popitem(last=False)
            elif event["type"] == "BlockRemoved":
                blocks.pop(block_hash, None)

    def _sweep_shared(self) -> None:
        """Forget shared blocks whose TTL passed unannounced (Redis expired them without a word)."""
        now = self._clock()
        for tier_id, blocks in list(self.shared.items()):
            while blocks:
                block = next(iter(blocks.values()))
                if block.expires_s >= now:
                    break
                blocks.popitem(last=False)
            if not blocks:
                del self.shared[tier_id]
        for tier_id in [t for t in self._shared_max if t not in self.shared]:
            del self._shared_max[tier_id]

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
