"""S3-FIFO with libCacheSim's exact semantics (``libCacheSim/cache/eviction/S3FIFO.c``).

Three FIFO queues: a small probation queue (10 % of the capacity), a main queue (the rest) run as a
CLOCK with a 2-bit counter, and a ghost queue of ids only (90 % of the capacity, i.e. main's size).

- A new block enters small, or main when its id is in ghost. Until the first eviction, a full small
  queue sends new blocks straight to main (libCacheSim's current S3FIFO, not the paper's S3FIFOv0).
- A hit adds one to the block's counter (the counter saturates at 3 in main).
- Evicting: from main when main is over its share or small is empty, else from small. Small's head
  moves to main (counter reset) when it was hit at least twice, else it is evicted and its id goes to
  ghost. Main's head with a non-zero counter is reinserted at main's tail with the counter minus one.

Prefix stores: a head the owner may not evict because it still has resident children (a prefix store
evicts leaves only) is not rotated: its evictable descendants go first (deepest first, from the parent
chain ``BlockMeta.parent`` gives), and the head is evicted once it is a leaf. Rotating it instead sent the
start of every prompt back to the tail, where it outlived its own descendants' reuse, and cost 1.5–3.7
points of hit ratio against S3-FIFO's flat self (``docs/eviction.md``). Blocks that are pinned (in use,
no evictable descendant) are passed over the way a CLOCK hand passes a pinned page: they go to the tail
of their queue with their counter unchanged. The cross-check test
(``tests/policies/test_eviction_crosscheck.py``) replays a trace through this class and through the
``libcachesim`` package and asserts the same hit ratio.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from policies.eviction_base import BlockId, BlockMeta, EvictionPolicy

_MAX_FREQ = 3  # 2-bit counter


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO: small probation FIFO + main CLOCK FIFO + ghost FIFO of ids."""

    name = "s3fifo"

    small_ratio = 0.10  # share of the capacity for the small queue
    ghost_ratio = 0.90  # ghost entries, as a share of the capacity
    move_to_main_threshold = 2  # hits in small needed to move to main

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self.small_capacity = int(capacity_blocks * self.small_ratio)
        self.main_capacity = capacity_blocks - self.small_capacity
        self.ghost_capacity = int(capacity_blocks * self.ghost_ratio)
        self._small: OrderedDict[BlockId, int] = OrderedDict()  # id -> hit counter, head is oldest
        self._main: OrderedDict[BlockId, int] = OrderedDict()
        self._ghost: OrderedDict[BlockId, None] = OrderedDict()
        self._ghost_hit: BlockId | None = None  # id whose on_miss found it in ghost
        self._has_evicted = False
        self._parent: dict[BlockId, BlockId] = {}  # tracked block -> its tracked parent
        self._children: dict[BlockId, set[BlockId]] = {}  # tracked block -> its tracked children

    def on_miss(self, block_id: BlockId, now: float) -> None:
        # libCacheSim consumes the ghost entry at lookup, before eviction can push it out of ghost.
        if self._pop_ghost(block_id):
            self._ghost_hit = block_id

    def on_insert(self, block_id: BlockId, meta: BlockMeta, now: float) -> None:
        if meta.parent is not None and meta.parent in self:
            self._parent[block_id] = meta.parent
            self._children.setdefault(meta.parent, set()).add(block_id)
        ghost_hit = self._ghost_hit == block_id or self._pop_ghost(block_id)
        self._ghost_hit = None
        small_is_full = len(self._small) >= self.small_capacity
        # libCacheSim refuses a block as large as the small queue; a pool cannot refuse a block it
        # holds, so a cache too small to have a small queue puts every block in main.
        if ghost_hit or self.small_capacity < 2 or (not self._has_evicted and small_is_full):
            self._main[block_id] = 0
        else:
            self._small[block_id] = 0

    def _pop_ghost(self, block_id: BlockId) -> bool:
        if block_id in self._ghost:
            del self._ghost[block_id]
            return True
        return False

    def on_hit(self, block_id: BlockId, now: float) -> None:
        if block_id in self._small:
            self._small[block_id] += 1
        elif block_id in self._main:
            self._main[block_id] = min(self._main[block_id] + 1, _MAX_FREQ)

    def on_remove(self, block_id: BlockId) -> None:
        if self._small.pop(block_id, None) is None:
            self._main.pop(block_id, None)
        self._unlink(block_id)

    def _unlink(self, block_id: BlockId) -> None:
        """Forget a block's place in the prefix tree (its children, if any, become roots)."""
        parent = self._parent.pop(block_id, None)
        if parent is not None:
            siblings = self._children[parent]
            siblings.discard(block_id)
            if not siblings:
                del self._children[parent]
        for child in self._children.pop(block_id, ()):
            del self._parent[child]

    def _evictable_descendant(
        self, block_id: BlockId, can_evict: Callable[[BlockId], bool]
    ) -> BlockId | None:
        """The deepest evictable descendant of ``block_id`` (depth-first), or None."""
        stack = list(self._children.get(block_id, ()))
        found: BlockId | None = None
        while stack:
            node = stack.pop()
            children = self._children.get(node)
            if children:
                stack.extend(children)
            elif can_evict(node):
                return node
            if found is None and can_evict(node):
                found = node
        return found

    def _evict_descendant_of(self, head: BlockId, can_evict: Callable[[BlockId], bool]) -> BlockId | None:
        victim = self._evictable_descendant(head, can_evict)
        if victim is None:
            return None
        if self._small.pop(victim, None) is not None:
            self._remember(victim)
        else:
            del self._main[victim]
        self._unlink(victim)
        return victim

    def _remember(self, block_id: BlockId) -> None:
        self._ghost[block_id] = None
        if len(self._ghost) > self.ghost_capacity:
            self._ghost.popitem(last=False)

    def evict(self, can_evict: Callable[[BlockId], bool]) -> BlockId | None:
        self._has_evicted = True
        if len(self._main) > self.main_capacity or not self._small:
            victim = self._evict_main(can_evict)
            return victim if victim is not None else self._evict_small(can_evict)
        victim = self._evict_small(can_evict)
        return victim if victim is not None else self._evict_main(can_evict)

    def _evict_small(self, can_evict: Callable[[BlockId], bool]) -> BlockId | None:
        passed = 0  # consecutive pinned blocks passed over; a full lap of them means none is evictable
        while self._small and passed < len(self._small):
            block_id, freq = self._small.popitem(last=False)
            if freq >= self.move_to_main_threshold:
                self._main[block_id] = 0
                passed = 0
            elif can_evict(block_id):
                self._remember(block_id)
                self._unlink(block_id)
                return block_id
            else:
                self._small[block_id] = freq
                self._small.move_to_end(block_id, last=False)  # back at the head
                victim = self._evict_descendant_of(block_id, can_evict)
                if victim is not None:
                    return victim
                self._small.move_to_end(block_id)
                passed += 1
        return None

    def _evict_main(self, can_evict: Callable[[BlockId], bool]) -> BlockId | None:
        # Each lap lowers every counter by one, so after _MAX_FREQ + 1 laps only pinned blocks remain.
        budget = (_MAX_FREQ + 1) * len(self._main) + 1
        while self._main and budget > 0:
            budget -= 1
            block_id, freq = self._main.popitem(last=False)
            if freq >= 1:
                self._main[block_id] = freq - 1
            elif can_evict(block_id):
                self._unlink(block_id)
                return block_id
            else:
                self._main[block_id] = 0
                self._main.move_to_end(block_id, last=False)  # back at the head
                victim = self._evict_descendant_of(block_id, can_evict)
                if victim is not None:
                    return victim
                self._main.move_to_end(block_id)
        return None

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._small or block_id in self._main
