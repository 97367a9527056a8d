"""ARC, the Adaptive Replacement Cache (Megiddo & Modha, FAST'03), as libCacheSim's ``ARC.c`` runs it.

libCacheSim's reading of the paper is kept where the paper is loose: ``p`` and its steps are floats,
REPLACE takes T1's block whenever T2 is empty, and case IV-A drops B1's oldest id whenever B1 is not
empty (else it evicts T1's oldest block without a ghost).

T1 holds blocks seen once recently, T2 blocks seen at least twice; B1 and B2 are ghost lists (ids only)
of blocks evicted from T1 and T2. A miss that finds its id in B1 grows ``p``, the target size of T1;
one found in B2 shrinks it. Eviction (REPLACE) takes T1's LRU block while T1 is over ``p``, else T2's.
The directory T1 ∪ B1 holds at most ``capacity`` ids, T1 ∪ T2 ∪ B1 ∪ B2 at most twice that.

Blocks the owner may not evict are skipped in place (LRU order is kept); if the chosen list has no
evictable block, the other list gives one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from policies.eviction_base import BlockId, BlockMeta, EvictionPolicy


def _first_evictable(
    order: OrderedDict[BlockId, None], can_evict: Callable[[BlockId], bool]
) -> BlockId | None:
    for block_id in order:
        if can_evict(block_id):
            return block_id
    return None


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache: recency list T1, frequency list T2, ghost lists B1/B2."""

    name = "arc"

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        # Each list is LRU-first: iteration starts at the least recently used id.
        self._t1: OrderedDict[BlockId, None] = OrderedDict()
        self._t2: OrderedDict[BlockId, None] = OrderedDict()
        self._b1: OrderedDict[BlockId, None] = OrderedDict()
        self._b2: OrderedDict[BlockId, None] = OrderedDict()
        self.target_t1_blocks = 0.0  # ARC's p
        self._ghost_hit: tuple[BlockId, int] | None = None  # (id, 1 or 2): the pending miss was in B1/B2

    def on_miss(self, block_id: BlockId, now: float) -> None:
        self._ghost_hit = None
        if block_id in self._b1:
            delta = max(len(self._b2) / len(self._b1), 1.0)
            self.target_t1_blocks = min(self.target_t1_blocks + delta, self.capacity_blocks)
            del self._b1[block_id]
            self._ghost_hit = (block_id, 1)
        elif block_id in self._b2:
            delta = max(len(self._b1) / len(self._b2), 1.0)
            self.target_t1_blocks = max(self.target_t1_blocks - delta, 0.0)
            del self._b2[block_id]
            self._ghost_hit = (block_id, 2)

    def on_insert(self, block_id: BlockId, meta: BlockMeta, now: float) -> None:
        if self._ghost_hit is None or self._ghost_hit[0] != block_id:
            self.on_miss(block_id, now)  # the owner skipped on_miss: adapt now
        if self._ghost_hit is not None:
            self._t2[block_id] = None
        else:
            self._t1[block_id] = None
        self._ghost_hit = None

    def on_hit(self, block_id: BlockId, now: float) -> None:
        if block_id in self._t1:
            del self._t1[block_id]
            self._t2[block_id] = None
        elif block_id in self._t2:
            self._t2.move_to_end(block_id)

    def on_hits(self, block_ids: Sequence[BlockId], now: float) -> None:
        t1, t2 = self._t1, self._t2
        for block_id in block_ids:
            if block_id in t1:
                del t1[block_id]
                t2[block_id] = None
            elif block_id in t2:
                t2.move_to_end(block_id)

    def on_remove(self, block_id: BlockId) -> None:
        if self._t1.pop(block_id, False) is False:
            self._t2.pop(block_id, None)

    def on_evicted(self, block_id: BlockId) -> None:
        for data, ghost in ((self._t1, self._b1), (self._t2, self._b2)):
            if block_id in data:
                del data[block_id]
                ghost[block_id] = None
                break
        else:
            return
        # The directory bounds that evict() keeps when ARC chooses its own victims.
        capacity = self.capacity_blocks
        while self._b1 and len(self._t1) + len(self._b1) > capacity:
            self._b1.popitem(last=False)
        while self._b2 and len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * capacity:
            self._b2.popitem(last=False)

    def evict(self, can_evict: Callable[[BlockId], bool]) -> BlockId | None:
        if self._ghost_hit is not None:
            return self._replace(can_evict, in_b2=self._ghost_hit[1] == 2)
        capacity = self.capacity_blocks
        if len(self._t1) + len(self._b1) >= capacity:
            if self._b1:
                self._b1.popitem(last=False)
                return self._replace(can_evict, in_b2=False)
            victim = _first_evictable(self._t1, can_evict)  # B1 empty: T1 fills the directory, no ghost
            if victim is not None:
                del self._t1[victim]
                return victim
            return self._replace(can_evict, in_b2=False)
        if len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) >= 2 * capacity and self._b2:
            self._b2.popitem(last=False)
        return self._replace(can_evict, in_b2=False)

    def _replace(self, can_evict: Callable[[BlockId], bool], *, in_b2: bool) -> BlockId | None:
        """ARC's REPLACE: move the LRU evictable block of T1 (to B1) or of T2 (to B2)."""
        size_t1, p = len(self._t1), self.target_t1_blocks
        from_t1 = (size_t1 > 0 and (size_t1 > p or (size_t1 == p and in_b2))) or not self._t2
        lists = ((self._t1, self._b1), (self._t2, self._b2))
        for data, ghost in lists if from_t1 else lists[::-1]:
            victim = _first_evictable(data, can_evict)
            if victim is not None:
                del data[victim]
                ghost[victim] = None
                return victim
        return None

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._t1 or block_id in self._t2
