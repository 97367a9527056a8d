"""The adaptive default's "leader's shadow first" lists, with the leaves findable without a walk.

For each shadow ``AdaptivePolicy`` keeps the real resident blocks that shadow no longer holds, in the
order it dropped them, and evicts the first one of the leader's list that ``can_evict`` accepts. A walk
of that list asks about every block before it: behind a prefix store those are mostly the blocks of the
running requests (in use, or inner blocks of a chain in use), which the leader's shadow dropped long ago
and the real cache can never drop while they run, so each eviction cost grew with the blocks in use.

``OutsideLists`` numbers the entries in list order and keeps a heap of the entries of the leader's
list that are leaves (another list's heap is built when it is first searched, after a switch). Behind
an owner that evicts leaves only (``EvictionPolicy.declare_leaf_only``) a block with a tracked child is
never accepted, so the first accepted leaf of the heap is the first accepted block of the list: the
same victim, asking about leaves only (the leaves still refused, one per running request, are asked
again, as the leaf followers ask them). Behind a flat owner every entry counts as a leaf.
"""

from __future__ import annotations

from collections.abc import Callable

from policies.eviction_base import BlockId
from policies.leaf_heap import pop_first_leaf, push_leaf, rebuild


class OutsideLists:
    """Ordered sets of block ids (``lists[k]``: id -> its number in list order); the one searched last has
    a heap of its leaves.

    A heap entry ``(number, id)`` is live while ``id`` is in the list under that number and has no tracked
    child; a block is pushed again when it becomes a leaf. Callers test membership and delete through
    ``lists[k]`` directly (a deletion leaves a stale heap entry), and add through ``add``.
    """

    def __init__(self, num_lists: int) -> None:
        self.lists: tuple[dict[BlockId, int], ...] = tuple({} for _ in range(num_lists))
        self._heaps: tuple[list[tuple[int, BlockId]], ...] = tuple([] for _ in range(num_lists))
        # Only the list searched last (the leader's) keeps its heap up to date; another one's heap is
        # rebuilt when it is searched (after a switch of leader): most entries of the others leave first.
        self._searched: int | None = None
        self._next_number = 0
        self._leaf_only = False
        self._parent_of: dict[BlockId, BlockId | None] = {}  # tracked id -> its tracked parent
        self._num_children: dict[BlockId, int] = {}  # tracked id -> tracked children (absent: none)

    def declare_leaf_only(self) -> None:
        """From now on blocks with a tracked child are inner: skipped, never asked about."""
        self._leaf_only = True

    def link(self, block_id: BlockId, parent: BlockId | None) -> None:
        """A block entered the real cache under ``parent`` (leaf-only owners; ignored otherwise)."""
        if not self._leaf_only or block_id in self._parent_of:
            return  # inserted again while tracked: its place in the tree stays
        if parent is not None and parent in self._parent_of:
            self._num_children[parent] = self._num_children.get(parent, 0) + 1
        else:
            parent = None
        self._parent_of[block_id] = parent

    def forget(self, block_id: BlockId) -> None:
        """A block left the real cache: out of every list and the tree; its parent may become a leaf.

        A child count is only ever too low (a parent removed and tracked again before its old children
        left), never too high: a block counted as a leaf is asked about, so the victims stay exact.
        """
        for order in self.lists:
            order.pop(block_id, None)
        parent = self._parent_of.pop(block_id, None)  # (the tree is empty behind a flat owner)
        num_children = self._num_children
        if block_id in num_children:  # an inner block (a purge): its children go too
            del num_children[block_id]
        if parent is None:
            return
        left = num_children.get(parent)
        if left is None:
            return
        if left > 1:
            num_children[parent] = left - 1
            return
        del num_children[parent]
        for k, order in enumerate(self.lists):
            number = order.get(parent)
            if number is not None:
                self._push(k, number, parent)

    def add(self, k: int, block_id: BlockId) -> None:
        """Append ``block_id`` to list ``k`` unless it is there already (then its place stays)."""
        order = self.lists[k]
        if block_id in order:
            return
        self._next_number += 1
        order[block_id] = self._next_number
        if k == self._searched and block_id not in self._num_children:
            self._push(k, self._next_number, block_id)

    def pop_first_evictable(self, k: int, can_evict: Callable[[BlockId], bool]) -> BlockId | None:
        """Remove and return list ``k``'s first block that ``can_evict`` accepts (None: none does).

        Only the list is changed: the caller forgets the victim (``forget``) with the rest of its state.
        """
        if k != self._searched:
            if self._searched is not None:
                self._heaps[self._searched].clear()  # not kept up to date from now on
            self._compact(k)
            self._searched = k
        heap = self._heaps[k]
        if not heap:
            return None
        return pop_first_leaf(heap, self.lists[k], self._num_children, can_evict)

    def _push(self, k: int, number: int, block_id: BlockId) -> None:
        if k == self._searched:  # another list's heap is rebuilt when it is searched
            push_leaf(self._heaps[k], self.lists[k], self._num_children, number, block_id)

    def _compact(self, k: int) -> None:
        rebuild(self._heaps[k], self.lists[k], self._num_children)
