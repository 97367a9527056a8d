"""Bookkeeping of the paged KV pool: blocks, reference counts, the free list and the prefix cache.

Plain Python, no torch: the model runner owns the tensor, this owns the ids. A block is *private* while
it is being filled, then *cached* once it is full and computed: it is published under its chained hash
and stays after its sequences finish, until the eviction policy picks it. Invariants:

- a cached block's parent (previous block of its chain) is cached too: eviction is leaf-first (a block
  with cached children is never a victim) and purge removes whole namespaces;
- a block with ``ref_count > 0`` is never evicted, reused or freed;
- ``free_block_ids`` holds exactly the blocks that are neither cached nor referenced;
- a cached block is *pinned* while it is referenced or has a pinned cached child (leaf-first eviction can
  never reach it); ``num_available_blocks`` counts only unpinned cached blocks, so it is exactly what
  ``allocate`` can get (tests check this against real allocations after random operations).

Reservations assume a reserved (dedicated) namespace's cached blocks form trees of their own, which holds
because dedicated tenants never share a prefix with another namespace (DESIGN "Isolation levels"). They
are shared max-min fairly between the namespaces asking, and released when a namespace's requests stop
asking (reserved_blocks 0) or it is purged.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from policies.eviction import BlockId, BlockMeta, make_policy
from policies.fair_share import max_min_shares
from policies.hashing import BlockHash


def content_id(block_hash: BlockHash) -> BlockId:
    """The id a policy sees for a block: stable for its content, unlike the slot it occupies.

    Policies remember ids across evictions (ghost lists, reuse history); a slot id would mix the history
    of unrelated blocks that happened to use the same slot.
    """
    return BlockId(int.from_bytes(block_hash[:8], "little"))


class NoFreeBlocksError(RuntimeError):
    """Every block is referenced or protected; nothing can be allocated."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0  # running sequences whose block table holds this block
    block_hash: BlockHash | None = None  # set while the block is cached (full, computed, published)
    token_ids: tuple[int, ...] = ()  # the block's tokens while cached: a guard against hash collisions
    parent_hash: BlockHash | None = None  # hash of the block before this one (None: first block)
    parent_id: int | None = None  # that block's id when it is cached in this pool
    num_children: int = 0  # cached blocks whose parent is this one
    num_pinned_children: int = 0  # of those, the ones referenced or with a pinned child themselves
    namespace_id: str = ""  # owner tag (purge, quotas)

    def reset(self) -> None:
        self.block_hash, self.token_ids, self.namespace_id = None, (), ""
        self.parent_hash, self.parent_id = None, None
        self.num_children = self.num_pinned_children = 0

    @property
    def pinned(self) -> bool:
        """Referenced, or an ancestor of a referenced cached block: no eviction order can free it now."""
        return self.ref_count > 0 or self.num_pinned_children > 0


class BlockManager:
    """Allocates blocks, shares cached prefixes and evicts through a policy from ``policies.eviction``."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        eviction_policy: str = "default",
        max_reserved_fraction: float = 0.5,
        require_parent: bool = True,
        on_evict: Callable[[Block], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """
        Args:
            require_parent: refuse to cache a block whose parent is not cached here (the device pool);
                lower tiers set it False, since a parent may live in a tier above.
            on_evict: called with a victim before it is reset (the tiers demote it from there).
        """
        self.block_size = block_size
        self.require_parent = require_parent
        self._on_evict = on_evict
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.hash_to_block_id: dict[BlockHash, int] = {}
        self._slot_of: dict[BlockId, int] = {}  # policy (content) id -> block id, for cached blocks
        self.policy = make_policy(eviction_policy, num_blocks)
        self.policy.declare_leaf_only()  # _can_evict refuses every block with cached children
        self.max_reserved_blocks = int(num_blocks * max_reserved_fraction)
        self.requested_blocks: dict[str, int] = {}  # namespace_id -> reservation its requests ask for
        self.reserved_blocks: dict[str, int] = {}  # namespace_id -> blocks protected from others (granted)
        # Called once per regrant with every grant that changed, (namespace_id, blocks granted; 0:
        # released), shrinks first. Set by the engine: the tiers below follow the device pool's grants
        # (all at once: a tier regrants once, not once per owner, when many are released together).
        self.on_reservations: Callable[[list[tuple[str, int]]], None] | None = None
        self._cached_by_ns: Counter[str] = Counter()
        self._evictable_by_ns: Counter[str] = Counter()  # cached blocks that are not pinned
        self.num_evictions = 0
        self._clock = clock
        # KV-event hooks (worker.kv_events): a block was published / unpublished. Set by the engine.
        self.on_cached: Callable[[Block], None] | None = None
        self.on_uncached: Callable[[Block], None] | None = None

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block_id)

    @property
    def num_evictable_blocks(self) -> int:
        return sum(self._evictable_by_ns.values())

    def num_available_blocks(self, namespace_id: str = "", *, ignore_reservations: bool = False) -> int:
        """Blocks that ``allocate`` could hand to ``namespace_id`` right now (free + evictable by it).

        Exact: ``allocate`` succeeds this many times in a row and not once more (pinned blocks and other
        owners' reservations are left out). ``ignore_reservations`` counts reserved blocks as evictable.
        """
        protected = 0
        if not ignore_reservations:
            for ns, reserved in self.reserved_blocks.items():
                if ns != namespace_id:
                    evictable = self._evictable_by_ns[ns]
                    protected += evictable - min(evictable, max(0, self._cached_by_ns[ns] - reserved))
        return self.num_free_blocks + self.num_evictable_blocks - protected

    def can_allocate(
        self, num_blocks: int, namespace_id: str = "", *, ignore_reservations: bool = False
    ) -> bool:
        return self.num_available_blocks(namespace_id, ignore_reservations=ignore_reservations) >= num_blocks

    def match_prefix(self, hashes: Sequence[BlockHash], token_blocks: Sequence[Sequence[int]]) -> list[int]:
        """Ids of the longest run of cached blocks matching ``hashes`` from the first block on.

        ``token_blocks[k]`` are block k's tokens; a hash hit whose tokens differ (a collision) ends the run.
        """
        matched: list[int] = []
        for block_hash, tokens in zip(hashes, token_blocks, strict=False):
            block_id = self.hash_to_block_id.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens):
                break
            matched.append(block_id)
        return matched

    # ---- reservations --------------------------------------------------------------------------
    def set_reservation(self, namespace_id: str, num_blocks: int) -> int:
        """Ask to protect up to ``num_blocks`` cached blocks of ``namespace_id`` from other owners'
        evictions (0: no reservation any more); returns the blocks granted to it.

        Together the grants never exceed ``max_reserved_blocks``: they are its max-min fair shares among
        the namespaces that ask (one asking for more than the cap cannot starve one asking later), so a
        new request may shrink the others' grants (``on_reservations`` tells which).
        """
        self.set_reservations({namespace_id: num_blocks})
        return self.reserved_blocks.get(namespace_id, 0)

    def set_reservations(self, num_blocks_by_namespace: Mapping[str, int]) -> None:
        """``set_reservation`` for many namespaces at once (a start-up, idle ones released together): the
        grants are shared once, and each namespace whose grant changes is told once."""
        changed = False
        for namespace_id, num_blocks in num_blocks_by_namespace.items():
            if self.requested_blocks.get(namespace_id, 0) == max(0, num_blocks):  # every request asks again
                continue
            changed = True
            if num_blocks > 0:
                self.requested_blocks[namespace_id] = num_blocks
            else:
                self.requested_blocks.pop(namespace_id, None)
        if changed:
            self._grant_reservations()

    def _grant_reservations(self) -> None:
        """Share ``max_reserved_blocks`` max-min fairly (``max_min_shares``) and report the grants that
        changed."""
        granted = max_min_shares(self.requested_blocks, self.max_reserved_blocks)
        before, self.reserved_blocks = self.reserved_blocks, granted
        changed = [(ns, granted.get(ns, 0)) for ns in sorted(before.keys() | granted.keys())]
        changed = [(ns, n) for ns, n in changed if n != before.get(ns, 0)]
        if self.on_reservations is not None and changed:
            self.on_reservations(sorted(changed, key=lambda c: c[1] > before.get(c[0], 0)))

    # ---- mutations -----------------------------------------------------------------------------
    def acquire(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks a new sequence reuses (counts as a hit for the policy)."""
        now = self._clock()
        # In prompt order, root first, as every owner reports a prompt's blocks: the adaptive default's
        # shadows count a hit as prefix-usable only when its parent was the access before it (reported
        # deepest first, none was, and the default never left its first expert in the worker).
        hit_ids: list[BlockId] = []
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.block_hash is not None, "only cached blocks are shared"
            was_pinned = block.pinned
            block.ref_count += 1
            if not was_pinned:
                self._pin_changed(block, pinned=True)
            hit_ids.append(content_id(block.block_hash))
        self.policy.on_hits(hit_ids, now)  # one call per request: the default's bookkeeping is batched

    def allocate(self, namespace_id: str = "", *, ignore_reservations: bool = False) -> int:
        """A fresh private block with ``ref_count == 1``, evicting a cached block if none is free.

        Raises:
            NoFreeBlocksError: every block is referenced or protected.
        """
        if not self.free_block_ids:
            self._evict_one(namespace_id, ignore_reservations=ignore_reservations)
        block_id = self.free_block_ids.popleft()
        self.blocks[block_id].ref_count = 1
        return block_id

    def allocate_many(
        self, num_blocks: int, namespace_id: str = "", *, ignore_reservations: bool = False
    ) -> list[int]:
        """``num_blocks`` fresh private blocks, or none at all.

        Raises:
            NoFreeBlocksError: fewer are available; nothing was taken (and nothing evicted).
        """
        if not self.can_allocate(num_blocks, namespace_id, ignore_reservations=ignore_reservations):
            raise NoFreeBlocksError(
                f"{num_blocks} blocks needed, {self.num_available_blocks(namespace_id)} available"
            )
        taken: list[int] = []
        try:
            for _ in range(num_blocks):
                taken.append(self.allocate(namespace_id, ignore_reservations=ignore_reservations))
        except BaseException:
            self.release(taken)  # all or nothing, even if the count above were ever wrong
            raise
        return taken

    def cache(
        self,
        block_id: int,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        parent_hash: BlockHash | None,
        *,
        namespace_id: str,
        position: int,
        request_blocks: int = 0,
    ) -> bool:
        """Publish a full, computed private block under its hash.

        Returns False (the block stays private and is freed with its sequence) when the hash is already
        cached by another block, or when the parent is no longer cached (the block could never be hit).
        """
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.hash_to_block_id:
            return False
        parent_id = None
        if parent_hash is not None:
            parent_id = self.hash_to_block_id.get(parent_hash)
            if parent_id is None and self.require_parent:
                return False
            if parent_id is not None:
                self.blocks[parent_id].num_children += 1
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        block.parent_hash, block.parent_id, block.namespace_id = parent_hash, parent_id, namespace_id
        self.hash_to_block_id[block_hash] = block_id
        self._cached_by_ns[namespace_id] += 1
        if block.pinned:
            self._pin_parent(block, pinned=True)
        else:
            self._evictable_by_ns[namespace_id] += 1
        meta = BlockMeta(
            position=position,
            parent=content_id(parent_hash) if parent_id is not None and parent_hash is not None else None,
            namespace_id=namespace_id,
            request_blocks=request_blocks,
        )
        self._slot_of[content_id(block_hash)] = block_id
        self.policy.on_insert(content_id(block_hash), meta, self._clock())
        if self.on_cached is not None:
            self.on_cached(block)
        return True

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop a finished or cancelled sequence's references; private blocks go back to the free list."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} released more often than acquired")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    block.reset()
                    self.free_block_ids.append(block_id)
                elif not block.pinned:
                    self._pin_changed(block, pinned=False)

    def purge(self, namespace_id: str) -> int:
        """Unpublish every cached block of ``namespace_id`` and their descendants; returns how many.

        Blocks still referenced by running sequences become private and are freed when those finish.
        """
        children: dict[int, list[int]] = {}
        for block in self.blocks:
            if block.block_hash is not None and block.parent_id is not None:
                children.setdefault(block.parent_id, []).append(block.block_id)
        victims = {
            b.block_id for b in self.blocks if b.block_hash is not None and b.namespace_id == namespace_id
        }
        stack = list(victims)
        while stack:  # descendants in other namespaces would be stranded: they go too
            for child in children.get(stack.pop(), ()):
                if child not in victims:
                    victims.add(child)
                    stack.append(child)
        for block_id in victims:
            self.policy.on_remove(content_id(self.blocks[block_id].block_hash))  # type: ignore[arg-type]
            self._uncache(block_id, leaving=victims)
        if namespace_id in self.requested_blocks:  # asked again by the owner's next request, if any
            self.set_reservation(namespace_id, 0)
        return len(victims)

    # ---- internals -----------------------------------------------------------------------------
    def _pin_changed(self, block: Block, *, pinned: bool) -> None:
        """A cached block became pinned (or unpinned): update the counts up its chain."""
        self._evictable_by_ns[block.namespace_id] += -1 if pinned else 1
        self._pin_parent(block, pinned=pinned)

    def _pin_parent(self, block: Block, *, pinned: bool) -> None:
        while block.parent_id is not None:
            parent = self.blocks[block.parent_id]
            was_pinned = parent.pinned
            parent.num_pinned_children += 1 if pinned else -1
            if parent.pinned == was_pinned:
                return
            self._evictable_by_ns[parent.namespace_id] += -1 if pinned else 1
            block = parent

    def _can_evict(self, block_id: int, requester: str, *, ignore_reservations: bool = False) -> bool:
        block = self.blocks[block_id]
        if block.ref_count or block.num_children or block.block_hash is None:
            return False
        owner = block.namespace_id
        reserved = 0 if ignore_reservations else self.reserved_blocks.get(owner, 0)
        return not (reserved and owner != requester and self._cached_by_ns[owner] <= reserved)

    def reclaim(self, num_blocks: int, namespace_id: str = "") -> int:
        """Evict up to ``num_blocks`` cached blocks at once (tiers demote in chunks); returns how many."""
        for done in range(num_blocks):
            if not self._evict_one(namespace_id, required=False):
                return done
        return num_blocks

    def _evict_one(self, requester: str, *, required: bool = True, ignore_reservations: bool = False) -> bool:
        chosen = self.policy.evict(
            lambda pid: self._can_evict(
                self._slot_of[pid], requester, ignore_reservations=ignore_reservations
            )
        )
        victim = None if chosen is None else self._slot_of[chosen]
        if victim is None:
            if required:
                raise NoFreeBlocksError("no free or evictable KV block")
            return False
        if self._on_evict is not None:
            self._on_evict(self.blocks[victim])
        self._uncache(victim, leaving={victim})
        self.num_evictions += 1
        return True

    def _uncache(self, block_id: int, *, leaving: set[int]) -> None:
        """Unpublish one block; ``leaving`` are all blocks unpublished together (a purge's whole set)."""
        block = self.blocks[block_id]
        assert block.block_hash is not None
        if self.on_uncached is not None:
            self.on_uncached(block)
        del self.hash_to_block_id[block.block_hash]
        del self._slot_of[content_id(block.block_hash)]
        if block.parent_id is not None and block.parent_id not in leaving:
            self.blocks[block.parent_id].num_children -= 1
            if block.pinned:  # a referenced block leaves the chain: it no longer holds its parent
                self._pin_parent(block, pinned=False)
        self._cached_by_ns[block.namespace_id] -= 1
        if not block.pinned:
            self._evictable_by_ns[block.namespace_id] -= 1
        # reset() also clears the child counts: evicted blocks are leaves, a purge takes the children too
        if block.ref_count == 0:
            block.reset()
            self.free_block_ids.append(block_id)
        else:
            block.reset()
