"""Eviction policies over block ids: pure objects picked from a registry.

A policy tracks the blocks resident in one cache (one tier's pool, or the simulator's cache) and, when
asked, names a victim. The owner of the blocks decides which blocks may go at all (blocks in use by a
running request, or blocks that still have cached children, are not evictable) and passes that as the
``can_evict`` predicate; the policy picks among the rest by its own order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping
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
    the block it returns.
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

    @abstractmethod
    def on_remove(self, block_id: BlockId) -> None:
        """A resident block left the cache for a reason other than ``evict`` (purge, stranded)."""

    @abstractmethod
    def evict(self, can_evict: Callable[[BlockId], bool]) -> BlockId | None:
        """Choose, forget and return a victim, or None if no tracked block may be evicted."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of tracked blocks."""

    def __contains__(self, block_id: object) -> bool:  # pragma: no cover - overridden where cheap
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self._order: OrderedDict[BlockId, None] = OrderedDict()

    def on_insert(self, block_id: BlockId, meta: BlockMeta, now: float) -> None:
        self._order[block_id] = None
        self._order.move_to_end(block_id)

    def on_hit(self, block_id: BlockId, now: float) -> None:
        self._order.move_to_end(block_id)

    def on_remove(self, block_id: BlockId) -> None:
        self._order.pop(block_id, None)

    def evict(self, can_evict: Callable[[BlockId], bool]) -> BlockId | None:
        for block_id in self._order:
            if can_evict(block_id):
                del self._order[block_id]
                return block_id
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._order


POLICIES: Mapping[str, type[EvictionPolicy]] = {cls.name: cls for cls in (LRUPolicy,)}
DEFAULT_POLICY = "lru"


def make_policy(name: str, capacity_blocks: int) -> EvictionPolicy:
    """Build a policy by registry name (``default`` is the worker's default)."""
    key = DEFAULT_POLICY if name == "default" else name
    try:
        return POLICIES[key](capacity_blocks)
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
