"""The eviction protocol: what a cache owner tells a policy, and what a policy answers.

A policy tracks the blocks resident in one cache (one tier's pool, or the simulator's cache) and, when
asked, names a victim. The owner of the blocks decides which blocks may go at all (blocks in use by a
running request, or blocks that still have cached children, are not evictable) and passes that as the
``can_evict`` predicate; the policy picks among the rest by its own order.

Call sequence for one block access, as the owner makes it:

- hit: ``on_hit(block_id, now)`` (or ``on_hits`` for a prompt's reused blocks at once);
- miss: ``on_miss(block_id, now)`` (optional for owners; ghost-based policies use it to see the
  block's history before the evictions that make room for it), then ``evict(can_evict)`` as many times
  as room is needed, then ``on_insert(block_id, meta, now)`` once the block holds its data.

An owner whose ``can_evict`` refuses every block with resident children says so once, before the first
insert, with ``declare_leaf_only()``; policies may then skip those blocks without asking.

Policies import nothing of ours beyond ``policies``: they are pure, deterministic and do no I/O.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, NewType

BlockId = NewType("BlockId", int)


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockMeta:
    """What a policy may know about a block when it enters the cache."""

    position: int  # index of the block within its prompt (0: the first block)
    parent: BlockId | None  # the block before it in the prefix chain, None for a first block
    namespace_id: str = ""  # owner tag; policies may group by it, never leak it
    request_blocks: int = 0  # full blocks in the prompt that brought the block in (0: unknown)


class EvictionPolicy(ABC):
    """Order of eviction for the resident blocks of one cache.

    Invariants: a block is tracked from ``on_insert`` until it is returned by ``evict`` or passed to
    ``on_remove``; ``evict`` only returns tracked blocks for which ``can_evict`` is true, and forgets
    the block it returns. ``capacity_blocks`` is the size of the cache the policy orders; policies with
    internal queues or ghost lists size them from it.
    """

    name: ClassVar[str]

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks

    @abstractmethod
    def on_insert(self, block_id: BlockId, meta: BlockMeta, now: float) -> None:
        """A block was admitted to the cache (after a miss)."""

    @abstractmethod
    def on_hit(self, block_id: BlockId, now: float) -> None:
        """A resident block was reused."""

    def on_hits(self, block_ids: Sequence[BlockId], now: float) -> None:
        """``on_hit`` for each of ``block_ids`` in order (a prompt's reused blocks, root first).

        One call per request instead of one per block; policies override it where a loop of their own
        is cheaper. It must leave the policy exactly as the ``on_hit`` calls would.
        """
        for block_id in block_ids:
            self.on_hit(block_id, now)

    def on_miss(self, block_id: BlockId, now: float) -> None:  # noqa: B027 - optional hook, no-op default
        """A lookup for ``block_id`` missed; called before the evictions that make room for it.

        Optional: an owner that never calls it still gets a working policy, since ``on_insert`` does the
        same bookkeeping when no ``on_miss`` came first.
        """

    @abstractmethod
    def on_remove(self, block_id: BlockId) -> None:
        """A resident block left the cache for a reason other than ``evict`` (purge, stranded)."""

    def declare_leaf_only(self) -> None:  # noqa: B027 - optional hook, no-op default
        """The owner's promise, made before the first ``on_insert``: its ``can_evict`` refuses every block
        that has a tracked child (a block inserted with it as ``BlockMeta.parent``, not evicted or removed
        since). A policy may then skip such blocks without asking; none may evict differently for it.

        Prefix stores that evict leaves only make it (the worker's ``BlockManager``, the prefix replay);
        flat owners, for which any block may go, do not.
        """

    def on_evicted(self, block_id: BlockId) -> None:
        """The owner evicted a resident block that another policy chose (a policy run beside others).

        Policies with ghost lists record it as if they had evicted it themselves; the default forgets it.
        """
        self.on_remove(block_id)

    @abstractmethod
    def evict(self, can_evict: Callable[[BlockId], bool]) -> BlockId | None:
        """Choose, forget and return a victim, or None if no tracked block may be evicted."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of tracked blocks."""

    def __contains__(self, block_id: object) -> bool:  # pragma: no cover - overridden where cheap
        raise NotImplementedError
