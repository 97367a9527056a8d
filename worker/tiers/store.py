"""The tiered KV store: moves blocks between the device pool (L1), host DRAM (L2), disk (L3) and Redis.

- Eviction from L1 demotes the block into L2 (a synchronous device→host copy: the slot is reused at once);
  eviction from L2 demotes chunks to a writer thread that stores them in L3 and the remote tier.
- A purge never waits for the writer on the engine thread: each queued chunk carries the write generation
  it was queued in, and the writer drops the blocks of a namespace purged since (``purge_local``); L3 and
  Redis are erased off the engine thread once the write under way, if any, has ended (``purge_stored``).
- When a request arrives, its prefix is looked up across tiers at once; blocks found only in L3 or Redis
  are prefetched into L2 by reader threads while the request waits for admission and other requests run;
  the request keeps its copy until admitted, within a byte budget of its own (``prefetch_bytes``).
- At admission the L2 part of the chain is copied into freshly allocated L1 blocks (copy thread or CUDA
  stream); the request prefills only after the copy is done.
- A tier is used only if loading from it is estimated faster than recomputing the blocks (measured
  bandwidth per tier vs the engine's measured prefill speed).

Every method except the worker threads' is called from the engine thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from policies.hashing import BlockHash
from worker.block_manager import Block, BlockManager
from worker.kv_events import KVEventLog, TierEvents
from worker.output import SOURCES
from worker.tiers.at_rest import AtRestCipher
from worker.tiers.disk import DiskTier
from worker.tiers.entry import BlockRecord, CorruptEntry
from worker.tiers.host import DemotedBlock, HostTier
from worker.tiers.prefetch_queue import FairQueue
from worker.tiers.remote import RemoteTier
from worker.tiers.transfer import Copier, Transfer

log = logging.getLogger("prefixgate.worker.tiers")


@dataclass(frozen=True, kw_only=True, slots=True)
class TierConfig:
    l2_bytes: int = 512 << 20
    prefetch_bytes: int = 512 << 20  # blocks prefetched and held for waiting requests (outside L2)
    l3_dir: Path | None = None
    l3_bytes: int = 4 << 30
    l3_codec: str = "none"
    remote_url: str | None = None
    remote_bytes: int = 1 << 30
    remote_ttl_s: float = 3600.0
    remote_timeout_s: float = 0.25
    remote_pause_s: float = 5.0  # skip the remote tier this long after an error or a timeout
    remote_codec: str = "none"
    l3_min_free_bytes: int = 256 << 20
    eviction_policy: str = "default"
    at_rest_key: str | None = field(default=None, repr=False)  # encrypt L3 and Redis entries (tiers.at_rest)


@dataclass(slots=True)
class PrefetchPlan:
    """Blocks of one request to fetch from L3 and/or Redis into L2 (a contiguous run of its chain)."""

    request_id: str
    start: int  # index of the first block to fetch in the request's chain
    hashes: list[BlockHash]
    token_blocks: list[list[int]]
    namespace_ids: list[str]
    disk_reads: list[tuple[int, list[int]]] = field(default_factory=list)  # (file id, positions), in order
    disk_blocks: int = 0
    use_remote: bool = False
    staged_bytes: int = 0  # of the prefetch budget, reserved for this plan's blocks
    owner: str = ""  # tenant tag of the request: prefetches queue per owner, owners are served in turn
    resume_at: int | None = None  # first block of the chain the budget cut off (None: none), planned later


@dataclass(slots=True)
class PrefetchResult:
    request_id: str
    start: int
    records: list[BlockRecord]
    sources: list[str]
    namespace_ids: list[str]
    data: torch.Tensor | None
    staged_bytes: int = 0  # of the prefetch budget, reserved for the plan (held until it is given back)
    owner: str = ""  # tenant tag of the request (whose share of the budget ``staged_bytes`` is)
    resume_at: int | None = None  # the plan's: where the chain continues once budget comes back

    def head(self, num_blocks: int) -> PrefetchResult:
        """The first ``num_blocks`` blocks of the run (a copy: the rest is freed)."""
        return PrefetchResult(
            request_id=self.request_id,
            start=self.start,
            records=self.records[:num_blocks],
            sources=self.sources[:num_blocks],
            namespace_ids=self.namespace_ids[:num_blocks],
            data=self.data[:num_blocks].clone() if num_blocks and self.data is not None else None,
            staged_bytes=self.staged_bytes,
            owner=self.owner,
        )

    def extend(self, more: PrefetchResult) -> PrefetchResult:
        """This run followed by ``more``, which continues it (one run, as the scheduler loads it)."""
        assert more.start == self.start + len(self.records)
        if self.data is None or more.data is None:
            data = more.data if self.data is None else self.data
        else:
            data = torch.cat([self.data, more.data])
        return PrefetchResult(
            request_id=self.request_id,
            start=self.start,
            records=self.records + more.records,
            sources=self.sources + more.sources,
            namespace_ids=self.namespace_ids + more.namespace_ids,
            data=data,
            staged_bytes=self.staged_bytes + more.staged_bytes,
            owner=self.owner,
            resume_at=more.resume_at,
        )


class Bandwidth:
    """Exponential moving average of measured bytes/s (starts from a prior)."""

    def __init__(self, prior_bps: float) -> None:
        self.bps = prior_bps
        self.samples = 0

    def record(self, num_bytes: int, seconds: float) -> None:
        if num_bytes <= 0 or seconds <= 0:
            return
        rate = num_bytes / seconds
        self.bps = rate if self.samples == 0 else 0.7 * self.bps + 0.3 * rate
        self.samples += 1


class TieredStore:
    def __init__(
        self,
        config: TierConfig,
        *,
        fingerprint: bytes,
        kv_cache: torch.Tensor,
        bytes_per_block: int,
        prefill_tokens_per_s: Callable[[], float],
        post: Callable[[tuple[str, Any]], None],
        kv_events: KVEventLog | None = None,
    ) -> None:
        self.config = config
        self.block_shape = tuple(kv_cache.shape[1:])
        self.block_size = self.block_shape[2]
        self.dtype = kv_cache.dtype
        self.bytes_per_block = bytes_per_block
        self._prefill_rate = prefill_tokens_per_s
        self._post = post
        self.copier = Copier(kv_cache)
        self.l2 = HostTier(
            capacity_blocks=max(1, config.l2_bytes // bytes_per_block),
            block_shape=self.block_shape,
            dtype=self.dtype,
            pin_memory=kv_cache.is_cuda,
            eviction_policy=config.eviction_policy,
            on_demote=self._enqueue_demotion,
        )
        cipher = AtRestCipher(config.at_rest_key) if config.at_rest_key else None
        self.disk = None
        self.disk_open_failed = False  # --l3-dir given but unusable (read-only, no permission): no L3
        if config.l3_dir is not None:
            try:
                self.disk = DiskTier(
                    config.l3_dir,
                    budget_bytes=config.l3_bytes,
                    fingerprint=fingerprint,
                    codec=config.l3_codec,
                    block_shape=self.block_shape,
                    dtype=self.dtype,
                    eviction_policy=config.eviction_policy,
                    min_free_bytes=config.l3_min_free_bytes,
                    cipher=cipher,
                    events=TierEvents(kv_events, "L3") if kv_events is not None else None,
                )
            except OSError as exc:  # the worker still serves, from L1 and L2 (and Redis)
                log.warning(
                    "running without the L3 disk tier: cannot use --l3-dir %s: %s", config.l3_dir, exc
                )
                self.disk_open_failed = True
        self.remote = None
        if config.remote_url:
            self.remote = RemoteTier(
                config.remote_url,
                fingerprint=fingerprint,
                codec=config.remote_codec,
                block_shape=self.block_shape,
                dtype=self.dtype,
                budget_bytes=config.remote_bytes,
                ttl_s=config.remote_ttl_s,
                timeout_s=config.remote_timeout_s,
                cipher=cipher,
                pause_after_error_s=config.remote_pause_s,
                events=TierEvents(kv_events, "remote") if kv_events is not None else None,
            )
            self.remote.identify()
        self.bandwidth = {
            "l2": Bandwidth(self._calibrate_copy()),
            "l3": Bandwidth(500e6),
            "remote": Bandwidth(100e6),
        }
        # Host bytes reserved for prefetches in flight and held by waiting requests, per owner (tenant
        # tag: its fair share; engine thread only).
        self.staged_by_owner: dict[str, int] = {}
        self.prefetch_skipped_blocks = 0  # cut from arrivals' prefetches by the budget (some read later)
        self.hits = dict.fromkeys(SOURCES, 0)
        self.gated = dict.fromkeys(SOURCES, 0)  # blocks found but recomputed because loading was slower
        self._writes: queue.Queue[tuple[int, list[DemotedBlock]] | None] = queue.Queue(maxsize=256)
        self.dropped_demotions = 0
        self._write_generation = 0  # bumped by every purge (engine thread); queued chunks carry it
        # namespace -> (write generation of its latest purge, chunks queued before it): the writer drops
        # its blocks queued before, and forgets the purge once it has taken those chunks
        self._purged_writes: dict[str, tuple[int, int]] = {}
        # Guards ``_purged_writes`` and the chunk counts (never held across I/O); notified per chunk written.
        self._chunk_written = threading.Condition()
        self._num_chunks_queued = 0  # chunks put on ``_writes`` (counted before the put: never < taken)
        self._num_chunks_taken = 0  # chunks the writer has filtered (the one being written included)
        self._num_chunks_written = 0
        self._writer = threading.Thread(target=self._write_loop, name="kv-writer", daemon=True)
        self._writer.start()
        self._prefetches: FairQueue[PrefetchPlan] = FairQueue()
        self._readers = [
            threading.Thread(target=self._read_loop, name=f"kv-prefetch-{i}", daemon=True) for i in range(2)
        ]
        for reader in self._readers:
            reader.start()

    # ---- cost gate -------------------------------------------------------------------------------
    def _calibrate_copy(self) -> float:
        """Host→pool copy speed of this machine, measured once at start-up."""
        probe = torch.empty((8, *self.block_shape), dtype=self.dtype)
        target = torch.empty_like(probe)
        target.copy_(probe)
        started = time.perf_counter()
        for _ in range(5):
            target.copy_(probe)
        seconds = max(time.perf_counter() - started, 1e-9)
        return 5 * probe.numel() * probe.element_size() / seconds

    def worth_loading(self, tier: str, num_blocks: int) -> bool:
        """Is loading ``num_blocks`` from ``tier`` estimated faster than recomputing them?"""
        rate = self._prefill_rate()
        if num_blocks <= 0 or rate <= 0:
            return num_blocks > 0
        codec = {
            "l3": self.disk.codec if self.disk else None,
            "remote": self.remote.codec if self.remote else None,
        }.get(tier)
        per_block = codec.payload_bytes(self.block_shape, self.dtype) if codec else self.bytes_per_block
        load_s = num_blocks * per_block / self.bandwidth[tier].bps
        recompute_s = num_blocks * self.block_size / rate
        return load_s < recompute_s

    # ---- demotion ----------------------------------------------------------------------------------
    def demote_from_l1(self, block: Block) -> None:
        """The device pool's eviction hook: keep the victim in L2."""
        if block.block_hash is None:
            return
        record = BlockRecord(
            block_hash=block.block_hash, parent_hash=block.parent_hash, token_ids=block.token_ids
        )
        data = self.copier.kv_cache[block.block_id]
        if self.l2.put(record, block.namespace_id, 0, data) is None and block.block_hash not in self.l2:
            # Every L2 slot is pinned by a load in flight: write the block through to disk and Redis
            # rather than lose it (the slot in L1 is reused at once, so this is a copy).
            victim = DemotedBlock(
                record=record, namespace_id=block.namespace_id, position=0, data=data.to("cpu", copy=True)
            )
            self._enqueue_demotion([victim])

    def _enqueue_demotion(self, blocks: list[DemotedBlock]) -> None:
        if self.disk is None and self.remote is None:
            return
        with self._chunk_written:
            self._num_chunks_queued += 1
        try:
            self._writes.put_nowait((self._write_generation, blocks))
        except queue.Full:  # the disk is slower than eviction: it is a cache, drop rather than stall
            with self._chunk_written:
                self._num_chunks_queued -= 1
            self.dropped_demotions += len(blocks)

    def _write_loop(self) -> None:
        # Idle, the writer still renews this worker's Redis reservation leases (other workers count them).
        renew_s = self.remote.requests.lease_ms / 4000 if self.remote is not None else None
        while True:
            try:
                item = self._writes.get(timeout=renew_s)
            except queue.Empty:
                try:
                    self.remote.renew_reservations()
                except Exception:  # the writer must outlive any bug here
                    log.exception("renewing the Redis reservations failed")
                continue
            if item is None:
                self._writes.task_done()
                return
            try:
                blocks = self._unpurged(*item)
                if blocks and self.disk is not None:
                    self.disk.write(blocks)
                if blocks and self.remote is not None:
                    self.remote.put(blocks)
            except Exception:  # a failed write loses cache, never the worker
                log.exception("demotion write failed")
            finally:
                with self._chunk_written:  # a purge's erase may wait for this chunk (``purge_stored``)
                    self._num_chunks_written += 1
                    self._chunk_written.notify_all()
                self._writes.task_done()

    def _unpurged(self, generation: int, blocks: list[DemotedBlock]) -> list[DemotedBlock]:
        """The blocks of a chunk queued at ``generation`` whose namespace was not purged since (writer).

        Chunks are queued in generation order (engine thread), so once every chunk queued before a purge
        is taken (or one of its generation or later) none of them is left: the purge is forgotten."""
        with self._chunk_written:
            purged = self._purged_writes
            kept = [b for b in blocks if purged.get(b.namespace_id, (-1, 0))[0] <= generation]
            self._num_chunks_taken += 1
            taken = self._num_chunks_taken
            for namespace_id in [
                ns for ns, (g, before) in purged.items() if g <= generation or before <= taken
            ]:
                del purged[namespace_id]
        return kept

    # ---- prefetch (arrival) ------------------------------------------------------------------------
    def plan_prefetch(
        self,
        request_id: str,
        hashes: Sequence[BlockHash],
        token_blocks: Sequence[list[int]],
        namespace_ids: Sequence[str],
        num_l1: int,
        owner: str = "",
        from_block: int | None = None,
    ) -> tuple[PrefetchPlan | None, int | None]:
        """What to fetch for a request of tenant ``owner`` whose first ``num_l1`` blocks are in L1, from
        block ``from_block`` on at the earliest (a plan resumed: what it holds already); returns (the
        plan or None: nothing; the first block the budget cut off or None, to plan again once there is
        room). An owner holds at most its share of the budget (``_prefetch_room``). The owner is the
        tenant tag the gateway names, not the blocks' namespace: ``shared`` tenants all hash in the
        global namespace, and one of them must not take the others' share or lane."""
        start = num_l1 + len(self.l2.match(hashes[num_l1:], token_blocks[num_l1:]))
        start = max(start, from_block or 0)
        plan = PrefetchPlan(
            request_id=request_id,
            start=start,
            hashes=list(hashes[start:]),
            token_blocks=list(token_blocks[start:]),
            namespace_ids=list(namespace_ids[start:]),
            owner=owner,
        )
        room = self._prefetch_room(owner) // self.bytes_per_block
        if len(plan.hashes) > room:  # the budget is taken by what waiting requests hold: later, or recompute
            if from_block is None:  # counted once, when the request arrives (a resumed plan reads some)
                self.prefetch_skipped_blocks += len(plan.hashes) - room
            del plan.hashes[room:], plan.token_blocks[room:], plan.namespace_ids[room:]
            plan.resume_at = start + room
        if not plan.hashes:
            return None, plan.resume_at
        if self.disk is not None:
            found = self.disk.match(plan.hashes, plan.token_blocks)
            if found and not self.worth_loading("l3", len(found)):
                self.gated["l3"] += len(found)
                return None, None
            for file_id, position in found:
                last = plan.disk_reads[-1] if plan.disk_reads else None
                if last is not None and last[0] == file_id and last[1][-1] + 1 == position:
                    plan.disk_reads[-1][1].append(position)
                else:
                    plan.disk_reads.append((file_id, [position]))
            plan.disk_blocks = len(found)
        plan.use_remote = (
            self.remote is not None and self.remote.available and plan.disk_blocks < len(plan.hashes)
        )
        if not plan.disk_blocks and not plan.use_remote:
            return None, None
        if plan.disk_blocks < len(plan.hashes) and not plan.use_remote:
            plan.resume_at = None  # the chain ends on disk before the cut: nothing after it to fetch
        plan.staged_bytes = (len(plan.hashes) if plan.use_remote else plan.disk_blocks) * self.bytes_per_block
        self._stage(owner, plan.staged_bytes)
        return plan, plan.resume_at

    def has_prefetch_room(self, owner: str) -> bool:
        """Whether ``owner`` may stage a block now (a cut plan is worth planning again)."""
        return self._prefetch_room(owner) >= self.bytes_per_block

    def _prefetch_room(self, owner: str) -> int:
        """Bytes ``owner`` may stage now. With k owners staging (``owner`` included) each holds at most
        budget // (k + 1); one already staging also leaves budget // (k + 2) free, the share of an owner
        that stages nothing yet, so a newcomer always finds room while the earlier ones keep theirs."""
        budget, held = self.config.prefetch_bytes, self.staged_by_owner.get(owner, 0)
        staging = len(self.staged_by_owner) + (0 if held else 1)
        free = budget - self.staged_bytes - (budget // (staging + 2) if held else 0)
        return max(0, min(free, budget // (staging + 1) - held))

    def unstage(self, num_bytes: int, owner: str = "") -> None:
        """Give back prefetch budget (engine thread)."""
        self._stage(owner, -num_bytes)

    @property
    def staged_bytes(self) -> int:
        """Bytes of the prefetch budget reserved now, all owners together."""
        return sum(self.staged_by_owner.values())

    def _stage(self, owner: str, num_bytes: int) -> None:
        held = self.staged_by_owner.get(owner, 0) + num_bytes
        if held:
            self.staged_by_owner[owner] = held
        else:
            self.staged_by_owner.pop(owner, None)

    def drop_prefetched(self, seq: Any) -> None:
        """A request no longer needs what it prefetched (loaded into L1, finished, or purged)."""
        fetched, seq.prefetched = seq.prefetched, None
        if seq.staged_bytes:  # held with ``fetched``, charged to its owner (never raises: cleanup path)
            self.unstage(seq.staged_bytes, fetched.owner if fetched is not None else "")
        seq.staged_bytes = 0

    def start_prefetch(self, plan: PrefetchPlan) -> None:
        """Queue the reads (``prefetch_queue``: behind the owner's earlier prefetches only)."""
        self._prefetches.put(plan.owner, plan)

    def _read_loop(self) -> None:
        while (plan := self._prefetches.get()) is not None:
            try:
                self._fetch(plan)
            except Exception:  # a reader must outlive any one prefetch
                log.exception("prefetch of %s failed", plan.request_id)

    def _fetch(self, plan: PrefetchPlan) -> None:
        records: list[BlockRecord] = []
        sources: list[str] = []
        parts: list[torch.Tensor] = []
        try:
            if self.disk is not None:
                self.disk.will_need([file_id for file_id, _ in plan.disk_reads])
                for file_id, positions in plan.disk_reads:
                    t0 = time.perf_counter()
                    got, data = self.disk.read(file_id, positions[0], len(positions))
                    payload = len(positions) * self.disk.block_payload_bytes
                    self.bandwidth["l3"].record(payload, time.perf_counter() - t0)
                    records += got
                    sources += ["l3"] * len(got)
                    parts.append(data)
            if plan.use_remote and len(records) == plan.disk_blocks and self.remote is not None:
                k = len(records)
                if self.worth_loading("remote", 1):
                    t0 = time.perf_counter()
                    got, data = self.remote.get_run(
                        plan.namespace_ids[k:], plan.hashes[k:], plan.token_blocks[k:]
                    )
                    if got and data is not None:
                        per_block = self.remote.codec.payload_bytes(self.block_shape, self.dtype)
                        self.bandwidth["remote"].record(len(got) * per_block, time.perf_counter() - t0)
                        records += got
                        sources += ["remote"] * len(got)
                        parts.append(data)
        except CorruptEntry:
            pass  # the run ends at the damaged file; it was deleted and counted
        except Exception:
            log.exception("prefetch of %s failed", plan.request_id)
        data = torch.cat(parts) if parts else None
        result = PrefetchResult(
            request_id=plan.request_id,
            start=plan.start,
            records=records,
            sources=sources,
            namespace_ids=plan.namespace_ids[: len(records)],
            data=data,
            staged_bytes=plan.staged_bytes,
            owner=plan.owner,
            resume_at=plan.resume_at,
        )
        self._post(("prefetched", result))

    def finish_prefetch(self, result: PrefetchResult) -> dict[BlockHash, str]:
        """Offer fetched blocks to L2 (the request keeps its own copy); returns each block's origin tier."""
        if not result.records:
            return {}
        assert result.data is not None
        positions = range(result.start, result.start + len(result.records))
        self.l2.put_many(result.records, result.namespace_ids, positions, result.data)
        return {
            record.block_hash: source for record, source in zip(result.records, result.sources, strict=True)
        }

    # ---- admission ---------------------------------------------------------------------------------
    def match_l2(self, hashes: Sequence[BlockHash], token_blocks: Sequence[Sequence[int]]) -> list[int]:
        slots = self.l2.match(hashes, token_blocks)
        if slots and not self.worth_loading("l2", len(slots)):
            self.gated["l2"] += len(slots)
            return []
        return slots

    def load(self, source: torch.Tensor, indices: list[int], block_ids: list[int]) -> Transfer:
        """Copy host blocks ``source[indices]`` into L1 ``block_ids`` (pinned L2 slots stay until done)."""
        return self.copier.copy_in(source, indices, block_ids)

    def loaded(self, transfer: Transfer) -> None:
        self.bandwidth["l2"].record(transfer.num_bytes, transfer.seconds)

    # ---- maintenance -------------------------------------------------------------------------------
    def set_reservations(self, changes: Sequence[tuple[str, int]]) -> None:
        """Dedicated owners' quotas in L2 (blocks), L3 and Redis (the same number of blocks' bytes), each
        ``(namespace_id, num_blocks)`` (0: none any more); each tier regrants once for all of them."""
        self.l2.index.set_reservations(dict(changes))
        if self.disk is not None:
            per_file = self.disk.block_payload_bytes
            self.disk.set_reservations({ns: num_blocks * per_file for ns, num_blocks in changes})
        if self.remote is not None:  # payload plus the entry header (hashes, tokens, checksums)
            per_block = self.remote.codec.payload_bytes(self.block_shape, self.dtype) + 1024
            self.remote.set_reservations({ns: num_blocks * per_block for ns, num_blocks in changes})

    def wait_for_writes(self) -> None:
        """Block until every queued demotion has been written."""
        self._writes.join()

    def purge_local(self, namespace_id: str) -> dict[str, int]:
        """Erase a namespace from L2 and drop its queued writes (engine thread, never waits on the writer);
        L3 is ``purge_stored`` and Redis ``purge_remote``, off the engine thread, in that order."""
        if self.disk is not None or self.remote is not None:  # else nothing is ever queued
            self._write_generation += 1  # chunks queued from now on are not of the purge's past
            with self._chunk_written:  # none queued but not taken (a quiet worker): nothing to filter
                if self._num_chunks_queued > self._num_chunks_taken:
                    self._purged_writes[namespace_id] = (self._write_generation, self._num_chunks_queued)
        return {"l2": self.l2.purge(namespace_id)}

    def purge_stored(self, namespace_id: str) -> dict[str, int]:
        """Erase a namespace from L3 after ``purge_local`` (any thread): waits for the chunk being written
        now, if any (it may have been filtered before the purge); the chunks after it are filtered by the
        writer, so the wait is one chunk at most. Call it before ``purge_remote``, which relies on it."""
        with self._chunk_written:
            taken = self._num_chunks_taken
            self._chunk_written.wait_for(lambda: self._num_chunks_written >= taken)
        return {} if self.disk is None else {"l3": self.disk.purge(namespace_id)}

    def purge_remote(self, namespace_id: str) -> int | None:
        """Erase a namespace from Redis (any thread; None without a remote tier).

        Raises:
            RemoteUnavailable: Redis failed part-way.
        """
        return None if self.remote is None else self.remote.purge(namespace_id)

    def flush(self, pool: BlockManager) -> int:
        """Write every cached L1 and L2 block to disk (clean shutdown); returns blocks written."""
        if self.disk is None:
            return 0
        self._writes.join()
        blocks = [
            DemotedBlock(
                record=BlockRecord(block_hash=b.block_hash, parent_hash=b.parent_hash, token_ids=b.token_ids),
                namespace_id=b.namespace_id,
                position=0,
                data=self.copier.copy_out(b.block_id),
            )
            for b in pool.blocks
            if b.block_hash is not None and b.block_hash not in self.disk
        ]
        in_l1 = {b.record.block_hash for b in blocks}  # a block loaded back from L2 is in both: once
        blocks += [
            DemotedBlock(
                record=self.l2.record(b.block_id),
                namespace_id=b.namespace_id,
                position=position,
                data=self.l2.data[b.block_id].clone(),
            )
            for b, position in self.l2.resident()
            if b.block_hash not in self.disk and b.block_hash not in in_l1
        ]
        return self.disk.write(blocks)

    def close(self) -> None:
        self._writes.put(None)
        self._writer.join(timeout=30)
        self._prefetches.close()
        for reader in self._readers:
            reader.join(timeout=30)
        self.copier.close()
        if self.disk is not None:
            self.disk.close()  # after the flush and the writer: its directory may be used by another now

    def remote_tier(self) -> dict[str, Any] | None:
        """The shared Redis tier as KV-event consumers see it: its id, how long a block lives unread and
        how many blocks its budget holds (the gateway's bound on what it remembers of the tier)."""
        if self.remote is None or self.remote.tier_id is None:
            return None
        per_block = self.remote.codec.payload_bytes(self.block_shape, self.dtype)
        return {
            "id": self.remote.tier_id,
            "ttl_s": self.config.remote_ttl_s,
            "capacity_blocks": self.remote.budget_bytes // per_block,
        }

    def capacity_blocks(self) -> dict[str, int]:
        """Blocks L2 and L3 can hold (their budgets), for the gateway's bound on a worker's index entry."""
        out = {"L2": self.l2.capacity_blocks}
        if self.disk is not None:
            out["L3"] = self.disk.budget_bytes // self.disk.block_payload_bytes
        return out

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "hits_blocks": dict(self.hits),
            "gated_blocks": dict(self.gated),
            "bandwidth_gbps": {k: round(v.bps / 1e9, 3) for k, v in self.bandwidth.items()},
            "l2": {
                "blocks": self.l2.index.num_cached_blocks,
                "capacity_blocks": self.l2.capacity_blocks,
                "stored_total": self.l2.num_stored,
                "evictions_total": self.l2.index.num_evictions,
            },
            "demotions_dropped_total": self.dropped_demotions,
            "prefetch": {
                "staged_bytes": self.staged_bytes,
                "budget_bytes": self.config.prefetch_bytes,
                "skipped_blocks_total": self.prefetch_skipped_blocks,
            },
        }
        if self.disk is not None:
            out["l3"] = self.disk.stats()
        elif self.disk_open_failed:  # tier_accepting{tier="l3"} 0, tier_events{event="open_failed"} 1
            out["l3"] = {"accepting": 0, "open_failed_total": 1}
        if self.remote is not None:
            out["remote"] = self.remote.stats()
        return out
