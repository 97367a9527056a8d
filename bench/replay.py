"""Replay a request stream through one eviction policy object and count hits.

Three modes, each driving the policy object it is given:

- ``prefix``: a model of the worker's prefix store, making the protocol's calls in prompt order
  (``on_hit`` per reused block; ``on_miss``, evictions, ``on_insert`` per missing one). A request
  reuses the longest run of resident blocks from its start; the rest is recomputed and inserted in
  prompt order. The request's blocks are pinned while it runs and a block with resident children may
  not be evicted (leaf-first), so the store never holds a block whose parent is gone.
- ``flat``: libCacheSim's semantics, for the cross-check: every block id is one request of size 1 for a
  cache of ``capacity`` objects, with no pinning and no parent constraint. A block whose parent was
  evicted may stay resident; it counts as a flat hit but never as a prefix hit.
- ``worker``: the worker's own ``BlockManager`` instead of the model of it (``bench.replay_worker``), to
  check that ``prefix`` measures what the worker does.

All report the flat hit ratio (resident blocks found / blocks requested) and the prefix-usable hit
ratio (blocks found before the request's first miss / blocks requested).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from policies.eviction import BlockId, BlockMeta, EvictionPolicy

MODES = ("prefix", "flat", "worker")


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayRequest:
    """A request as the cache sees it: block ids already in their namespace."""

    now_s: float  # arrival time in seconds
    block_ids: tuple[BlockId, ...]  # prompt order
    namespace_id: str = ""  # owner tag passed to the policy in BlockMeta


@dataclass(frozen=True, kw_only=True, slots=True)
class HitCounts:
    """Hit counts of one replay (or the sum of several partitions)."""

    num_blocks: int  # blocks requested
    num_hits: int  # blocks resident when requested
    num_prefix_hits: int  # blocks resident when requested and preceded only by hits in their request

    @property
    def hit_ratio(self) -> float:
        return self.num_hits / self.num_blocks if self.num_blocks else 0.0

    @property
    def prefix_hit_ratio(self) -> float:
        return self.num_prefix_hits / self.num_blocks if self.num_blocks else 0.0

    def __add__(self, other: HitCounts) -> HitCounts:
        return HitCounts(
            num_blocks=self.num_blocks + other.num_blocks,
            num_hits=self.num_hits + other.num_hits,
            num_prefix_hits=self.num_prefix_hits + other.num_prefix_hits,
        )


def replay(
    requests: Iterable[ReplayRequest],
    policy: EvictionPolicy,
    capacity_blocks: int,
    *,
    mode: str = "prefix",
    on_request: Callable[[], None] | None = None,
) -> HitCounts:
    """Replay ``requests`` through ``policy`` in a cache of ``capacity_blocks`` blocks.

    Args:
        requests: the stream, in arrival order.
        policy: a fresh policy object (it is driven, not copied).
        capacity_blocks: cache size in blocks.
        mode: ``prefix`` (a model of the worker's store), ``flat`` (libCacheSim's semantics) or
            ``worker`` (the worker's ``BlockManager`` itself).
        on_request: called after each request (progress reporting).
    """
    if mode == "prefix":
        return _replay_prefix(requests, policy, capacity_blocks, on_request)
    if mode == "flat":
        return _replay_flat(requests, policy, capacity_blocks, on_request)
    if mode == "worker":
        from bench.replay_worker import replay_worker  # it imports this module

        return replay_worker(requests, policy, capacity_blocks, on_request)
    raise ValueError(f"unknown replay mode {mode!r}; known: {', '.join(MODES)}")


def _replay_prefix(
    requests: Iterable[ReplayRequest],
    policy: EvictionPolicy,
    capacity_blocks: int,
    on_request: Callable[[], None] | None,
) -> HitCounts:
    parent_of: dict[BlockId, BlockId | None] = {}  # resident block -> its resident parent
    num_children: dict[BlockId, int] = {}  # resident block -> resident children (absent: none)
    pinned: set[BlockId] = set()  # blocks of the running request

    def can_evict(block_id: BlockId) -> bool:
        return block_id not in pinned and block_id not in num_children

    policy.declare_leaf_only()  # can_evict refuses every block with resident children
    num_blocks = num_hits = num_prefix_hits = 0
    for request in requests:
        block_ids, now = request.block_ids, request.now_s
        num_blocks += len(block_ids)
        pinned.clear()
        in_prefix = True  # every block so far was a hit
        admitting = True  # false once the store had no room: later blocks would have no parent
        parent: BlockId | None = None
        for position, block_id in enumerate(block_ids):
            if block_id in parent_of:
                num_hits += 1
                num_prefix_hits += in_prefix
                policy.on_hit(block_id, now)
                pinned.add(block_id)
                parent = block_id
                continue
            in_prefix = False
            if not admitting:
                continue
            policy.on_miss(block_id, now)
            if len(parent_of) >= capacity_blocks:
                victim = policy.evict(can_evict)
                if victim is None:
                    admitting = False
                    continue
                victim_parent = parent_of.pop(victim)
                if victim_parent is not None:
                    _drop_child(num_children, victim_parent)
            if parent is not None and parent in parent_of:
                num_children[parent] = num_children.get(parent, 0) + 1
            else:
                parent = None
            parent_of[block_id] = parent
            meta = BlockMeta(
                position=position,
                parent=parent,
                namespace_id=request.namespace_id,
                request_blocks=len(block_ids),
            )
            policy.on_insert(block_id, meta, now)
            pinned.add(block_id)
            parent = block_id
        if on_request is not None:
            on_request()
    return HitCounts(num_blocks=num_blocks, num_hits=num_hits, num_prefix_hits=num_prefix_hits)


def _drop_child(num_children: dict[BlockId, int], parent: BlockId) -> None:
    left = num_children[parent] - 1
    if left:
        num_children[parent] = left
    else:
        del num_children[parent]


def _replay_flat(
    requests: Iterable[ReplayRequest],
    policy: EvictionPolicy,
    capacity_blocks: int,
    on_request: Callable[[], None] | None,
) -> HitCounts:
    resident: set[BlockId] = set()

    def anything(block_id: BlockId) -> bool:
        return True

    num_blocks = num_hits = num_prefix_hits = 0
    for request in requests:
        block_ids, now = request.block_ids, request.now_s
        num_blocks += len(block_ids)
        in_prefix = True
        previous: BlockId | None = None
        for position, block_id in enumerate(block_ids):
            if block_id in resident:
                num_hits += 1
                num_prefix_hits += in_prefix
                policy.on_hit(block_id, now)
            else:
                in_prefix = False
                policy.on_miss(block_id, now)
                while len(resident) >= capacity_blocks:
                    victim = policy.evict(anything)
                    if victim is None:
                        break
                    resident.discard(victim)
                if len(resident) < capacity_blocks:
                    resident.add(block_id)
                    meta = BlockMeta(
                        position=position,
                        parent=previous,
                        namespace_id=request.namespace_id,
                        request_blocks=len(block_ids),
                    )
                    policy.on_insert(block_id, meta, now)
            previous = block_id
        if on_request is not None:
            on_request()
    return HitCounts(num_blocks=num_blocks, num_hits=num_hits, num_prefix_hits=num_prefix_hits)


def total(counts: Sequence[HitCounts]) -> HitCounts:
    """Sum of the counts of several partitions (``dedicated`` isolation)."""
    result = HitCounts(num_blocks=0, num_hits=0, num_prefix_hits=0)
    for part in counts:
        result = result + part
    return result
