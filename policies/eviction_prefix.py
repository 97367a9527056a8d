"""Prefix-aware eviction: leaf-first, reuse-rate ranked, with an adaptive probation segment.

Four ideas, none of them tied to one trace (every size below is a multiple of the capacity):

1. **Leaf-first by construction.** The policy rebuilds the prefix tree from ``BlockMeta.parent`` and only
   ever ranks leaves (blocks without resident children), so evicting never strands a descendant and
   never scans past inner blocks. A chain is consumed from its tail, which keeps the start of every
   prompt, the part the most requests share, the longest. ``can_evict`` stays the owner's final word
   (pinned blocks are set aside and keep their place).
2. **Reuse memory.** The access count and first-access time of recently evicted blocks are remembered
   (ids and two integers, ``ghost_factor`` × capacity of them), so a block that is recomputed after
   eviction is known to be reused.
3. **Probation for blocks seen once.** Most blocks of a prompt seen for the first time (one-off
   questions, documents nobody asks about again) are never reused; they wait in a probation segment
   (LRU) while blocks seen at least twice sit in a protected segment. Probation is evicted first while
   it is over its target size. The target is learned by hill climbing: a miss on a block recently
   evicted from probation grows it by one block, a miss on one recently evicted from protected shrinks
   it (two equal windows of ``probe_window_factor`` × capacity victims each, so the two counts are the
   marginal hit rates of one more block in either segment).
4. **Reuse-rate ranking in protected.** A reused block is treated as a Poisson source whose rate is
   estimated from its own history, ``n / (span + prior)``; the rank key is
   ``last access + recency_scale × ln(rate)``: a block with ``e`` times the reuse rate stays one
   ``recency_scale`` (one capacity's worth of accesses) longer. The key is fixed between accesses, so
   ranking is a heap: O(log n) per operation, no scan per eviction.

Time is the policy's own access clock (one tick per insert or hit), never the wall clock.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from policies.eviction_base import BlockId, BlockMeta, EvictionPolicy

PROBATION, PROTECTED = 0, 1


@dataclass(slots=True)
class _Block:
    """A resident block's bookkeeping."""

    parent: BlockId | None  # resident parent, None for a root (or a parent that was not resident)
    num_children: int  # resident children; only blocks with none are ranked
    segment: int  # PROBATION or PROTECTED
    num_accesses: int  # inserts and hits, including those remembered from before an eviction
    first_clock: int  # access clock of the first remembered access
    last_clock: int  # access clock of the latest access
    key: float  # rank within its segment; smallest is evicted first


class PrefixAwarePolicy(EvictionPolicy):
    """Leaf-first eviction with adaptive probation and reuse-rate ranking (see the module docstring)."""

    name = "prefix"

    ghost_factor = 16  # remembered evicted blocks, × capacity
    max_ghost_blocks = 1 << 20  # hard cap on remembered blocks (~220 bytes each), whatever the capacity
    probe_window_factor = 0.25  # recent victims per segment watched for misses, × capacity
    rate_prior_factor = 0.25  # prior span (accesses) added to a block's observed span, × capacity
    recency_scale_factor = 1.0  # accesses one e-fold of reuse rate is worth, × capacity

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        capacity = max(capacity_blocks, 1)
        self.ghost_capacity = min(self.ghost_factor * capacity, self.max_ghost_blocks)
        self.probe_window = max(1, int(self.probe_window_factor * capacity))
        self.rate_prior = self.rate_prior_factor * capacity
        self.recency_scale = self.recency_scale_factor * capacity
        self.target_probation_blocks = 0  # learned; probation is evicted first while above it
        self._clock = 0
        self._blocks: dict[BlockId, _Block] = {}
        self._num_blocks = [0, 0]  # per segment
        self._leaves: tuple[list[tuple[float, BlockId]], ...] = ([], [])  # per segment; stale entries allowed
        self._history: OrderedDict[BlockId, tuple[int, int]] = OrderedDict()  # id -> (accesses, first clock)
        self._recent_victims = (OrderedDict[BlockId, None](), OrderedDict[BlockId, None]())
        # The block inserted last, a leaf not yet in its heap. A prompt's blocks are inserted root first,
        # so the next insert is most often its child and its entry would only go stale; it is ranked
        # when another block is inserted, or when an eviction could take it.
        self._unranked: BlockId | None = None

    # -- owner calls ---------------------------------------------------------------------------------

    def on_miss(self, block_id: BlockId, now: float) -> None:
        self._learn_from_miss(block_id)

    def on_insert(self, block_id: BlockId, meta: BlockMeta, now: float) -> None:
        self._learn_from_miss(block_id)
        self._clock += 1
        num_accesses, first_clock = self._history.pop(block_id, (0, self._clock))
        num_accesses += 1
        parent = meta.parent if meta.parent in self._blocks else None
        if parent is not None:
            self._blocks[parent].num_children += 1
            if parent == self._unranked:
                self._unranked = None  # an inner block now: never ranked until it is a leaf again
        segment = PROTECTED if num_accesses >= 2 else PROBATION
        block = _Block(
            parent=parent,
            num_children=0,
            segment=segment,
            num_accesses=num_accesses,
            first_clock=first_clock,
            last_clock=self._clock,
            key=0.0,
        )
        self._blocks[block_id] = block
        self._num_blocks[segment] += 1
        if self._unranked is not None:
            self._rank_unranked(self._unranked)
        self._unranked = block_id

    def on_hit(self, block_id: BlockId, now: float) -> None:
        block = self._blocks.get(block_id)
        if block is None:
            return
        self._clock += 1
        block.num_accesses += 1
        block.last_clock = self._clock
        if block.segment == PROBATION:
            self._num_blocks[PROBATION] -= 1
            self._num_blocks[PROTECTED] += 1
            block.segment = PROTECTED
        self._rank(block_id, block)

    def on_hits(self, block_ids: Sequence[BlockId], now: float) -> None:
        blocks, num_blocks, clock = self._blocks, self._num_blocks, self._clock
        for block_id in block_ids:
            block = blocks.get(block_id)
            if block is None:
                continue
            clock += 1
            block.num_accesses += 1
            block.last_clock = clock
            if block.segment == PROBATION:
                num_blocks[PROBATION] -= 1
                num_blocks[PROTECTED] += 1
                block.segment = PROTECTED
            if block.num_children == 0:
                self._push_leaf(block_id, block)
        self._clock = clock

    def on_remove(self, block_id: BlockId) -> None:
        if block_id in self._blocks:
            self._forget(block_id)

    def on_evicted(self, block_id: BlockId) -> None:
        block = self._blocks.get(block_id)
        if block is not None:
            self._forget(block_id)
            self._remember_victim(block.segment, block_id)

    def evict(self, can_evict: Callable[[BlockId], bool]) -> BlockId | None:
        unranked = self._unranked
        if unranked is not None and can_evict(unranked):  # else it cannot be the victim now
            self._rank_unranked(unranked)
        over_target = self._num_blocks[PROBATION] > self.target_probation_blocks
        order = (PROBATION, PROTECTED) if over_target else (PROTECTED, PROBATION)
        for segment in order:
            victim = self._pop_leaf(segment, can_evict)
            if victim is not None:
                self._forget(victim)
                self._remember_victim(segment, victim)
                return victim
        return None

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._blocks

    # -- internals ----------------------------------------------------------------------------------

    def _learn_from_miss(self, block_id: BlockId) -> None:
        """Hill-climb the probation target on misses that a slightly larger segment would have hit."""
        if block_id in self._recent_victims[PROBATION]:
            del self._recent_victims[PROBATION][block_id]
            self.target_probation_blocks = min(self.target_probation_blocks + 1, self.capacity_blocks)
        elif block_id in self._recent_victims[PROTECTED]:
            del self._recent_victims[PROTECTED][block_id]
            self.target_probation_blocks = max(self.target_probation_blocks - 1, 0)

    def _remember_victim(self, segment: int, block_id: BlockId) -> None:
        recent = self._recent_victims[segment]
        recent[block_id] = None
        if len(recent) > self.probe_window:
            recent.popitem(last=False)

    def _rank_unranked(self, block_id: BlockId) -> None:
        """Rank ``block_id``, the block inserted last (resident: leaving the cache unsets it)."""
        self._unranked = None
        block = self._blocks[block_id]
        if block.num_children == 0:
            self._push_leaf(block_id, block)

    def _rank(self, block_id: BlockId, block: _Block) -> None:
        # Only leaves are ranked: an inner block's key is computed when it becomes a leaf (in
        # ``_push_leaf``), from the same fields, so it is the key this access would have given it.
        if block.num_children == 0:
            self._push_leaf(block_id, block)

    def _push_leaf(self, block_id: BlockId, block: _Block) -> None:
        if block.segment == PROBATION:
            block.key = float(block.last_clock)
        else:
            span = block.last_clock - block.first_clock + self.rate_prior
            block.key = block.last_clock + self.recency_scale * math.log(block.num_accesses / span)
        heap = self._leaves[block.segment]
        heapq.heappush(heap, (block.key, block_id))
        if len(heap) > 2 * len(self._blocks) + 64:
            self._compact(block.segment)

    def _compact(self, segment: int) -> None:
        """Drop stale heap entries (left by hits and by blocks that gained children)."""
        live = [
            (block.key, block_id)
            for block_id, block in self._blocks.items()
            if block.segment == segment and block.num_children == 0 and block_id != self._unranked
        ]
        heapq.heapify(live)
        self._leaves[segment][:] = live

    def _is_live(self, segment: int, key: float, block_id: BlockId) -> bool:
        block = self._blocks.get(block_id)
        return block is not None and block.segment == segment and block.key == key and block.num_children == 0

    def _pop_leaf(self, segment: int, can_evict: Callable[[BlockId], bool]) -> BlockId | None:
        """Pop the lowest-ranked evictable leaf of ``segment``; pinned leaves keep their place."""
        heap = self._leaves[segment]
        pinned: list[tuple[float, BlockId]] = []
        victim = None
        while heap:
            key, block_id = heapq.heappop(heap)
            if not self._is_live(segment, key, block_id):
                continue
            if can_evict(block_id):
                victim = block_id
                break
            pinned.append((key, block_id))
        for entry in pinned:
            heapq.heappush(heap, entry)
        return victim

    def _forget(self, block_id: BlockId) -> None:
        """Stop tracking a block; remember its history; its parent may become a leaf."""
        block = self._blocks.pop(block_id)
        if block_id == self._unranked:
            self._unranked = None
        self._num_blocks[block.segment] -= 1
        self._history[block_id] = (block.num_accesses, block.first_clock)
        if len(self._history) > self.ghost_capacity:
            self._history.popitem(last=False)
        parent = self._blocks.get(block.parent) if block.parent is not None else None
        if parent is not None and parent.num_children > 0:  # 0: a parent re-inserted after a purge
            parent.num_children -= 1
            if parent.num_children == 0:
                self._push_leaf(block.parent, parent)
