"""LRU and ARC for owners that evict leaves only: the same victims, without asking about inner blocks.

``LRUPolicy`` and ``ARCPolicy`` walk a list from its least recently used end and ask the owner's
``can_evict`` about every block on the way. In a prefix store a chain is inserted root first, so the
oldest blocks of a list are the inner blocks of the oldest chains, which the owner always refuses:
evicting a chain from its tail walks past all its inner blocks again for every victim. An owner whose
``can_evict`` refuses every block with a tracked child says so (``EvictionPolicy.declare_leaf_only``);
behind such an owner the first block of a list that ``can_evict`` accepts is its first accepted
*leaf*. ``LeafLRUPolicy`` and ``LeafARCPolicy`` keep the tree from ``BlockMeta.parent`` and, for each
list, a heap of its leaves keyed by the access stamp that orders the list, so they return the victims
``LRUPolicy`` and ``ARCPolicy`` return and ask ``can_evict`` about leaves only, in the same order.

The adaptive default uses them as followers behind owners that declare it (the worker's
``BlockManager``, the prefix replay). They are not in the registry: behind a flat owner (any block may
go) they would refuse to evict an inner block that ``LRUPolicy`` evicts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import ClassVar

from policies.eviction_arc import ARCPolicy
from policies.eviction_base import BlockId, BlockMeta, EvictionPolicy
from policies.eviction_lru import LRUPolicy
from policies.leaf_heap import pop_first_leaf, push_leaf


class _LeafLists(EvictionPolicy):
    """Lists of resident ids ordered by access stamp, each with a heap of its leaves (stale entries allowed).

    A heap entry ``(stamp, id)`` is live while ``id`` is in the list with that stamp and has no tracked
    child; a block is pushed again when it is touched as a leaf or becomes one.
    """

    num_lists: ClassVar[int]

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self._clock = 0
        # _lists[k]: resident id -> stamp of its latest access; the list's LRU order is ascending stamp
        self._lists: tuple[dict[BlockId, int], ...] = tuple({} for _ in range(self.num_lists))
        self._heaps: tuple[list[tuple[int, BlockId]], ...] = tuple([] for _ in range(self.num_lists))
        self._parent_of: dict[BlockId, BlockId | None] = {}  # tracked id -> its tracked parent
        self._num_children: dict[BlockId, int] = {}  # tracked id -> tracked children (absent: none)
        # The block inserted last, not yet in its heap: (list, stamp, id). The worker inserts a prompt's
        # new blocks root first with no eviction between, so its entry would most often only go stale.
        self._unpushed: tuple[int, int, BlockId] | None = None

    def _link(self, block_id: BlockId, meta: BlockMeta) -> None:
        if block_id in self._parent_of:
            return  # inserted again while tracked: its place in the tree stays
        parent = meta.parent
        if parent is not None and parent in self._parent_of:
            self._num_children[parent] = self._num_children.get(parent, 0) + 1
            if self._unpushed is not None and self._unpushed[2] == parent:
                self._unpushed = None  # an inner block now: its entry would be stale
        else:
            parent = None
        self._parent_of[block_id] = parent

    def _unlink(self, block_id: BlockId) -> None:
        """Forget a block that left every list; its parent may become a leaf.

        A count is only ever too low (a parent removed and tracked again before its old children left),
        never too high: a block counted as a leaf is asked about, so the victims stay exact.
        """
        self._num_children.pop(block_id, None)
        parent = self._parent_of.pop(block_id, None)
        if parent is None:
            return
        left = self._num_children.get(parent)
        if left is None:
            return
        if left > 1:
            self._num_children[parent] = left - 1
            return
        del self._num_children[parent]
        for k, order in enumerate(self._lists):
            stamp = order.get(parent)
            if stamp is not None:
                self._push(k, stamp, parent)
                return

    def _touch(self, k: int, block_id: BlockId) -> None:
        """(Re)place ``block_id`` at the most recent end of list ``k``."""
        self._clock += 1
        self._lists[k][block_id] = self._clock
        if block_id not in self._num_children:
            self._push(k, self._clock, block_id)

    def _insert_into(self, k: int, block_id: BlockId) -> None:
        """Place a block just linked at the most recent end of list ``k``; its heap entry waits."""
        if self._unpushed is not None:
            self._push(*self._unpushed)
        self._clock += 1
        self._lists[k][block_id] = self._clock
        self._unpushed = (k, self._clock, block_id) if block_id not in self._num_children else None

    def _stamp(self, k: int, block_ids: Sequence[BlockId], *, num_joining: int = 0) -> None:
        """``_touch`` for each tracked block of ``block_ids`` (in order), in bulk; the others are ignored.

        ``num_joining`` of them were just taken out of another list to join list ``k``.
        """
        order, clock = self._lists[k], self._clock
        size = len(order)
        order.update(zip(block_ids, range(clock + 1, clock + 1 + len(block_ids)), strict=True))
        self._clock = clock + len(block_ids)
        if len(order) != size + num_joining:  # untracked ids were added: take them out again
            parent_of = self._parent_of
            untracked = [block_id for block_id in order.keys() & block_ids if block_id not in parent_of]
            for block_id in untracked:
                del order[block_id]
            block_ids = [block_id for block_id in block_ids if block_id in parent_of]
        num_children = self._num_children
        for block_id in [block_id for block_id in block_ids if block_id not in num_children]:
            self._push(k, order[block_id], block_id)

    def _push(self, k: int, stamp: int, block_id: BlockId) -> None:
        push_leaf(self._heaps[k], self._lists[k], self._num_children, stamp, block_id)

    def _pop_first_evictable(self, k: int, can_evict: Callable[[BlockId], bool]) -> BlockId | None:
        """Remove and return list ``k``'s least recently used leaf that ``can_evict`` accepts."""
        if self._unpushed is not None:
            self._push(*self._unpushed)
            self._unpushed = None
        victim = pop_first_leaf(self._heaps[k], self._lists[k], self._num_children, can_evict)
        if victim is not None:
            self._unlink(victim)
        return victim

    def _drop(self, block_id: BlockId) -> int | None:
        """Take a block out of its list (not evicted by us); the list it was in, or None if untracked."""
        for k, order in enumerate(self._lists):
            if order.pop(block_id, None) is not None:
                self._unlink(block_id)
                return k
        return None

    def on_remove(self, block_id: BlockId) -> None:
        self._drop(block_id)

    def __len__(self) -> int:
        return sum(len(order) for order in self._lists)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._parent_of


class LeafLRUPolicy(_LeafLists):
    """``LRUPolicy``'s victims behind an owner that evicts leaves only."""

    name = LRUPolicy.name
    num_lists = 1

    def on_insert(self, block_id: BlockId, meta: BlockMeta, now: float) -> None:
        self._link(block_id, meta)
        self._insert_into(0, block_id)

    def on_hit(self, block_id: BlockId, now: float) -> None:
        if block_id in self._parent_of:
            self._touch(0, block_id)

    def on_hits(self, block_ids: Sequence[BlockId], now: float) -> None:
        self._stamp(0, block_ids)

    def evict(self, can_evict: Callable[[BlockId], bool]) -> BlockId | None:
        return self._pop_first_evictable(0, can_evict)


class LeafARCPolicy(_LeafLists):
    """``ARCPolicy``'s victims (and ghosts, and ``p``) behind an owner that evicts leaves only.

    T1 is list 0, T2 list 1; every step is ``ARCPolicy``'s (see ``eviction_arc``), with its list walk
    replaced by the leaf heap.
    """

    name = ARCPolicy.name
    num_lists = 2

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self._b1: OrderedDict[BlockId, None] = OrderedDict()
        self._b2: OrderedDict[BlockId, None] = OrderedDict()
        self.target_t1_blocks = 0.0  # ARC's p
        self._ghost_hit: tuple[BlockId, int] | None = None  # (id, 1 or 2): the pending miss was in B1/B2

    on_miss = ARCPolicy.on_miss  # the ghost lists' adaptation, the same fields

    def on_insert(self, block_id: BlockId, meta: BlockMeta, now: float) -> None:
        if self._ghost_hit is None or self._ghost_hit[0] != block_id:
            self.on_miss(block_id, now)  # the owner skipped on_miss: adapt now
        self._link(block_id, meta)
        self._insert_into(1 if self._ghost_hit is not None else 0, block_id)
        self._ghost_hit = None

    def on_hit(self, block_id: BlockId, now: float) -> None:
        self.on_hits((block_id,), now)

    def on_hits(self, block_ids: Sequence[BlockId], now: float) -> None:
        t1, num_moved = self._lists[0], 0
        if t1:
            moved = t1.keys() & block_ids  # T1 -> T2
            for block_id in moved:
                del t1[block_id]
            num_moved = len(moved)
        self._stamp(1, block_ids, num_joining=num_moved)

    def on_evicted(self, block_id: BlockId) -> None:
        k = self._drop(block_id)
        if k is None:
            return
        (self._b1 if k == 0 else self._b2)[block_id] = None
        # The directory bounds that evict() keeps when ARC chooses its own victims.
        capacity, t1, t2 = self.capacity_blocks, *self._lists
        while self._b1 and len(t1) + len(self._b1) > capacity:
            self._b1.popitem(last=False)
        while self._b2 and len(t1) + len(t2) + len(self._b1) + len(self._b2) > 2 * capacity:
            self._b2.popitem(last=False)

    def evict(self, can_evict: Callable[[BlockId], bool]) -> BlockId | None:
        if self._ghost_hit is not None:
            return self._replace(can_evict, in_b2=self._ghost_hit[1] == 2)
        capacity, t1, t2 = self.capacity_blocks, *self._lists
        if len(t1) + len(self._b1) >= capacity:
            if self._b1:
                self._b1.popitem(last=False)
                return self._replace(can_evict, in_b2=False)
            victim = self._pop_first_evictable(0, can_evict)  # B1 empty: T1 fills the directory, no ghost
            if victim is not None:
                return victim
            return self._replace(can_evict, in_b2=False)
        if len(t1) + len(t2) + len(self._b1) + len(self._b2) >= 2 * capacity and self._b2:
            self._b2.popitem(last=False)
        return self._replace(can_evict, in_b2=False)

    def _replace(self, can_evict: Callable[[BlockId], bool], *, in_b2: bool) -> BlockId | None:
        """ARC's REPLACE: move the LRU evictable block of T1 (to B1) or of T2 (to B2)."""
        t1, t2 = self._lists
        size_t1, p = len(t1), self.target_t1_blocks
        from_t1 = (size_t1 > 0 and (size_t1 > p or (size_t1 == p and in_b2))) or not t2
        for k in (0, 1) if from_t1 else (1, 0):
            victim = self._pop_first_evictable(k, can_evict)
            if victim is not None:
                (self._b1 if k == 0 else self._b2)[victim] = None
                return victim
        return None
