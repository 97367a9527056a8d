"""Shadow caches of the adaptive default: one expert alone on an id-only prefix store of its own.

A shadow keeps the owner's rules (a prompt's blocks are pinned while it runs, only leaves are evicted) so
that its score tracks the expert's own hit ratio, and counts prefix-usable hits only: a hit whose parent
was the previous access and was usable (owners report a prompt's blocks in order).

The prefix-aware expert ranks leaves itself, so its shadow drives the policy object. LRU and ARC scan
their lists from the least recently used end past every block that is pinned or has children: inside a
shadow, where the tree is known, that scan is most of the cost (a chain is inserted root first, so its
inner blocks are the oldest). ``LRUShadow`` and ``ARCShadow`` make exactly the same choices as
``LRUPolicy`` and ``ARCPolicy`` behind a leaf-only, unpinned ``can_evict``, but keep each list's
*leaves* in a heap keyed by the access stamp that orders the list: the first evictable block of a list
is its evictable leaf with the smallest stamp.

A prompt's hits that a shadow holds whole (most of them) are applied in bulk (``hit_all``), with the
prompt walk (``walk_hits``: usable flags, pins) computed once for every shadow that starts where it does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import ClassVar

from policies.eviction_base import BlockId, BlockMeta, EvictionPolicy
from policies.leaf_heap import pop_first_leaf, push_leaf


@dataclass(frozen=True, slots=True)
class HitWalk:
    """What a run of hits does to a shadow's prompt state, the same in every shadow that holds them all."""

    usable: list[bool]  # per block: a prefix-usable hit
    last_reset: int  # index of the last block that started a new prompt (unpinned the last), or -1
    last_position: int  # position of the last block
    last_usable: BlockId | None  # the last block, if it was usable


def walk_hits(
    block_ids: Sequence[BlockId],
    metas: Sequence[BlockMeta],
    last_position: int,
    last_usable: BlockId | None,
    *,
    sampled: bool,
) -> HitWalk:
    """The prompt bookkeeping of ``Shadow.access_many`` for blocks that are all resident, once for all."""
    usable_flags: list[bool] = []
    last_reset = -1
    for i, (block_id, meta) in enumerate(zip(block_ids, metas, strict=True)):
        position = meta.position
        if position <= last_position:
            last_reset = i
        last_position = position
        usable = sampled or position == 0 or meta.parent == last_usable
        last_usable = block_id if usable else None
        usable_flags.append(usable)
    return HitWalk(usable_flags, last_reset, last_position, last_usable)


class Shadow:
    """The owner's side of a shadow: residents, their tree, the pinned prompt; the order is a subclass's."""

    __slots__ = (
        "capacity_blocks",
        "last_position",
        "last_usable",
        "num_children",
        "parent_of",
        "pinned",
        "sampled",
        "victims",
    )

    def __init__(self, capacity_blocks: int, *, sampled: bool) -> None:
        self.capacity_blocks = capacity_blocks
        self.parent_of: dict[BlockId, BlockId | None] = {}  # resident -> resident parent
        self.num_children: dict[BlockId, int] = {}  # resident -> resident children (absent: none)
        self.pinned: set[BlockId] = set()  # blocks of the prompt being replayed
        self.sampled = sampled  # sees one id in ``sample_rate``: no chains to follow, every hit counts
        self.last_position = -1  # position of the previous access (a drop starts a new prompt)
        self.last_usable: BlockId | None = None  # the previous access, if it was a usable hit
        self.victims: list[BlockId] = []  # what it evicted since the owner last cleared this list

    def access(self, block_id: BlockId, meta: BlockMeta, now: float) -> bool:
        """Replay one access of the real cache's stream; True if it was a prefix-usable hit."""
        if meta.position <= self.last_position:
            self.pinned.clear()
        self.last_position = meta.position
        if block_id in self.parent_of:
            self.pinned.add(block_id)
            self._hit(block_id, now)
            usable = self.sampled or meta.position == 0 or meta.parent == self.last_usable
            self.last_usable = block_id if usable else None
            return usable
        self.last_usable = None
        self._miss(block_id, now)
        if len(self.parent_of) >= self.capacity_blocks:
            victim = self._evict()
            if victim is None:
                return False
            self.victims.append(victim)
            victim_parent = self.parent_of.pop(victim)
            if victim_parent is not None:
                left = self.num_children[victim_parent] - 1
                if left:
                    self.num_children[victim_parent] = left
                else:
                    del self.num_children[victim_parent]
                    self._became_leaf(victim_parent)
        parent = meta.parent if meta.parent in self.parent_of and not self.sampled else None
        if parent is not None:
            self.num_children[parent] = self.num_children.get(parent, 0) + 1
        self.parent_of[block_id] = parent
        self.pinned.add(block_id)
        self._insert(block_id, meta, now)
        return False

    def access_many(self, block_ids: Sequence[BlockId], metas: Sequence[BlockMeta], now: float) -> list[bool]:
        """``access`` for each block in order; the list of its results.

        Runs of hits go to the order in one ``_hits`` call: a hit changes neither the residents nor
        their tree, and the pinned set is read only by evictions, which come after the run is applied.
        """
        parent_of, pinned, sampled = self.parent_of, self.pinned, self.sampled
        last_position, last_usable = self.last_position, self.last_usable
        results: list[bool] = []
        run: list[BlockId] = []
        for block_id, meta in zip(block_ids, metas, strict=True):
            if block_id not in parent_of:
                if run:
                    self._hits(run, now)
                    run = []
                self.last_position, self.last_usable = last_position, last_usable
                results.append(self.access(block_id, meta, now))
                last_position, last_usable = self.last_position, self.last_usable
                continue
            position = meta.position
            if position <= last_position:
                pinned.clear()
            last_position = position
            pinned.add(block_id)
            run.append(block_id)
            usable = sampled or position == 0 or meta.parent == last_usable
            last_usable = block_id if usable else None
            results.append(usable)
        if run:
            self._hits(run, now)
        self.last_position, self.last_usable = last_position, last_usable
        return results

    def holds_all(self, block_ids: AbstractSet[BlockId]) -> bool:
        """Whether every block is resident here (then ``hit_all`` may replay them)."""
        return self.parent_of.keys() >= block_ids

    def hit_all(self, block_ids: Sequence[BlockId], walk: HitWalk, now: float) -> None:
        """``access_many`` for blocks that are all resident, with their ``walk`` computed by the caller.

        Only the pins left at the end are kept: no eviction reads them during a run of hits.
        """
        pinned = self.pinned
        if walk.last_reset >= 0:
            pinned.clear()
            pinned.update(block_ids[walk.last_reset :])
        else:
            pinned.update(block_ids)
        self.last_position = walk.last_position
        self.last_usable = walk.last_usable
        self._hits(block_ids, now)

    @property
    def is_full(self) -> bool:
        return len(self.parent_of) >= self.capacity_blocks

    def _can_evict(self, block_id: BlockId) -> bool:
        return block_id not in self.pinned and block_id not in self.num_children

    def _hit(self, block_id: BlockId, now: float) -> None:
        self._hits((block_id,), now)

    def _hits(self, block_ids: Sequence[BlockId], now: float) -> None:
        raise NotImplementedError

    def _miss(self, block_id: BlockId, now: float) -> None:
        raise NotImplementedError

    def _insert(self, block_id: BlockId, meta: BlockMeta, now: float) -> None:
        raise NotImplementedError

    def _evict(self) -> BlockId | None:
        raise NotImplementedError

    def _became_leaf(self, block_id: BlockId) -> None:
        """A resident block lost its last resident child."""


class PolicyShadow(Shadow):
    """A shadow that drives an ``EvictionPolicy`` object through the protocol (the prefix-aware expert)."""

    __slots__ = ("policy",)

    def __init__(self, policy: EvictionPolicy, *, sampled: bool) -> None:
        super().__init__(policy.capacity_blocks, sampled=sampled)
        self.policy = policy

    def _hit(self, block_id: BlockId, now: float) -> None:
        self.policy.on_hit(block_id, now)

    def _hits(self, block_ids: Sequence[BlockId], now: float) -> None:
        self.policy.on_hits(block_ids, now)

    def _miss(self, block_id: BlockId, now: float) -> None:
        self.policy.on_miss(block_id, now)

    def _insert(self, block_id: BlockId, meta: BlockMeta, now: float) -> None:
        self.policy.on_insert(block_id, meta, now)

    def _evict(self) -> BlockId | None:
        return self.policy.evict(self._can_evict)


class _LeafHeaps(Shadow):
    """Lists ordered by access stamp, each with a heap of its leaves (stale entries allowed)."""

    __slots__ = ("clock", "heaps", "lists", "unpushed")

    def __init__(self, capacity_blocks: int, *, sampled: bool, num_lists: int) -> None:
        super().__init__(capacity_blocks, sampled=sampled)
        self.clock = 0
        # lists[k]: resident id -> stamp of its latest access; ``LRUPolicy``'s order is ascending stamp
        self.lists: tuple[dict[BlockId, int], ...] = tuple({} for _ in range(num_lists))
        self.heaps: tuple[list[tuple[int, BlockId]], ...] = tuple([] for _ in range(num_lists))
        # The block inserted last, not yet in its heap: (list, stamp, id). A prompt's blocks are inserted
        # root first, so the next insert is most often its child and its entry would only go stale. It
        # is pinned until the prompt ends, so no eviction can want it before: it is pushed then.
        self.unpushed: tuple[int, int, BlockId] | None = None

    hit_list: ClassVar[int] = 0  # the list a hit moves a block to (ARC: T2, leaving T1)

    def access(self, block_id: BlockId, meta: BlockMeta, now: float) -> bool:
        """``Shadow.access`` with a miss's insert inlined and its leaf entry deferred (``unpushed``)."""
        if block_id in self.parent_of:
            return super().access(block_id, meta, now)
        if meta.position <= self.last_position:
            self.pinned.clear()
        self.last_position = meta.position
        self.last_usable = None
        self._miss(block_id, now)
        parent_of, num_children = self.parent_of, self.num_children
        if len(parent_of) >= self.capacity_blocks:
            victim = self._evict()
            if victim is None:
                return False
            self.victims.append(victim)
            victim_parent = parent_of.pop(victim)
            if victim_parent is not None:
                left = num_children[victim_parent] - 1
                if left:
                    num_children[victim_parent] = left
                else:
                    del num_children[victim_parent]
                    self._became_leaf(victim_parent)
        parent = meta.parent if not self.sampled else None
        unpushed = self.unpushed
        if parent is not None and parent in parent_of:
            num_children[parent] = num_children.get(parent, 0) + 1
            if unpushed is not None and unpushed[2] == parent:
                unpushed = None  # an inner block now: its entry would be stale
        else:
            parent = None
        if unpushed is not None:
            self._push(*unpushed)
        parent_of[block_id] = parent
        self.pinned.add(block_id)
        k = self._insert_list()
        self.clock += 1
        self.lists[k][block_id] = self.clock
        self.unpushed = (k, self.clock, block_id)
        return False

    def _insert_list(self) -> int:
        """The list a missed block enters."""
        return 0

    def access_many(self, block_ids: Sequence[BlockId], metas: Sequence[BlockMeta], now: float) -> list[bool]:
        """``Shadow.access_many`` with a hit's move inlined: the hot path of a prompt's reused blocks."""
        parent_of, pinned, sampled, num_children = (
            self.parent_of,
            self.pinned,
            self.sampled,
            self.num_children,
        )
        k, push = self.hit_list, self._push
        order, leaving = self.lists[k], (self.lists[0] if k else None)
        last_position, last_usable, clock = self.last_position, self.last_usable, self.clock
        results: list[bool] = []
        for block_id, meta in zip(block_ids, metas, strict=True):
            if block_id not in parent_of:
                self.last_position, self.last_usable, self.clock = last_position, last_usable, clock
                results.append(self.access(block_id, meta, now))
                last_position, last_usable, clock = self.last_position, self.last_usable, self.clock
                continue
            position = meta.position
            if position <= last_position:
                pinned.clear()
            last_position = position
            pinned.add(block_id)
            if leaving is not None:
                leaving.pop(block_id, None)
            clock += 1
            order[block_id] = clock
            if block_id not in num_children:
                push(k, clock, block_id)
            usable = sampled or position == 0 or meta.parent == last_usable
            last_usable = block_id if usable else None
            results.append(usable)
        self.last_position, self.last_usable, self.clock = last_position, last_usable, clock
        return results

    def _hits(self, block_ids: Sequence[BlockId], now: float) -> None:
        """Hits of resident blocks, in order: one stamp each, in bulk (ARC: leaving T1 for T2)."""
        k = self.hit_list
        if k and self.lists[0]:
            leaving = self.lists[0]
            for block_id in leaving.keys() & block_ids:
                del leaving[block_id]
        order, clock = self.lists[k], self.clock
        order.update(zip(block_ids, range(clock + 1, clock + 1 + len(block_ids)), strict=True))
        self.clock = clock + len(block_ids)
        num_children = self.num_children
        for block_id in [block_id for block_id in block_ids if block_id not in num_children]:
            self._push(k, order[block_id], block_id)

    def _touch(self, k: int, block_id: BlockId) -> None:
        """(Re)place ``block_id`` at the most recent end of list ``k``."""
        self.clock += 1
        self.lists[k][block_id] = self.clock
        if block_id not in self.num_children:
            self._push(k, self.clock, block_id)

    def _push(self, k: int, stamp: int, block_id: BlockId) -> None:
        push_leaf(self.heaps[k], self.lists[k], self.num_children, stamp, block_id)

    def _became_leaf(self, block_id: BlockId) -> None:
        for k, order in enumerate(self.lists):
            stamp = order.get(block_id)
            if stamp is not None:
                self._push(k, stamp, block_id)
                return

    def _pop_first_evictable(self, k: int) -> BlockId | None:
        """Remove and return list ``k``'s least recently used evictable block (pinned ones stay put)."""
        pinned = self.pinned
        unpushed = self.unpushed
        if unpushed is not None and unpushed[2] not in pinned:
            self.unpushed = None
            self._push(*unpushed)
        return pop_first_leaf(self.heaps[k], self.lists[k], self.num_children, lambda b: b not in pinned)


class LRUShadow(_LeafHeaps):
    """``LRUPolicy`` on a shadow: least recently used evictable leaf first."""

    __slots__ = ()

    def __init__(self, capacity_blocks: int, *, sampled: bool) -> None:
        super().__init__(capacity_blocks, sampled=sampled, num_lists=1)

    def _hit(self, block_id: BlockId, now: float) -> None:
        self._touch(0, block_id)

    def _miss(self, block_id: BlockId, now: float) -> None:
        pass

    def _evict(self) -> BlockId | None:
        return self._pop_first_evictable(0)


class ARCShadow(_LeafHeaps):
    """``ARCPolicy`` on a shadow, step for step (see ``eviction_arc``): T1 is list 0, T2 list 1."""

    __slots__ = ("b1", "b2", "ghost_hit", "target_t1_blocks")
    hit_list = 1

    def __init__(self, capacity_blocks: int, *, sampled: bool) -> None:
        super().__init__(capacity_blocks, sampled=sampled, num_lists=2)
        self.b1: OrderedDict[BlockId, None] = OrderedDict()
        self.b2: OrderedDict[BlockId, None] = OrderedDict()
        self.target_t1_blocks = 0.0  # ARC's p
        self.ghost_hit = 0  # 1 or 2: the pending miss was found in B1 or B2

    def _hit(self, block_id: BlockId, now: float) -> None:
        t1 = self.lists[0]
        if block_id in t1:
            del t1[block_id]
        self._touch(1, block_id)

    def _miss(self, block_id: BlockId, now: float) -> None:
        b1, b2 = self.b1, self.b2
        self.ghost_hit = 0
        if block_id in b1:
            delta = max(len(b2) / len(b1), 1.0)
            self.target_t1_blocks = min(self.target_t1_blocks + delta, self.capacity_blocks)
            del b1[block_id]
            self.ghost_hit = 1
        elif block_id in b2:
            delta = max(len(b1) / len(b2), 1.0)
            self.target_t1_blocks = max(self.target_t1_blocks - delta, 0.0)
            del b2[block_id]
            self.ghost_hit = 2

    def _insert_list(self) -> int:
        k = 1 if self.ghost_hit else 0
        self.ghost_hit = 0
        return k

    def _evict(self) -> BlockId | None:
        if self.ghost_hit:
            return self._replace(in_b2=self.ghost_hit == 2)
        t1, t2 = self.lists
        capacity = self.capacity_blocks
        if len(t1) + len(self.b1) >= capacity:
            if self.b1:
                self.b1.popitem(last=False)
                return self._replace(in_b2=False)
            victim = self._pop_first_evictable(0)  # B1 empty: T1 fills the directory, no ghost
            if victim is not None:
                return victim
            return self._replace(in_b2=False)
        if len(t1) + len(t2) + len(self.b1) + len(self.b2) >= 2 * capacity and self.b2:
            self.b2.popitem(last=False)
        return self._replace(in_b2=False)

    def _replace(self, *, in_b2: bool) -> BlockId | None:
        """ARC's REPLACE: move the LRU evictable block of T1 (to B1) or of T2 (to B2)."""
        t1, t2 = self.lists
        size_t1, p = len(t1), self.target_t1_blocks
        from_t1 = (size_t1 > 0 and (size_t1 > p or (size_t1 == p and in_b2))) or not t2
        for k in (0, 1) if from_t1 else (1, 0):
            victim = self._pop_first_evictable(k)
            if victim is not None:
                (self.b1 if k == 0 else self.b2)[victim] = None
                return victim
        return None
