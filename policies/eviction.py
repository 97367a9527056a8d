"""Eviction policies over block ids: pure objects picked from a registry.

A policy tracks the blocks resident in one cache (one tier's pool, or the simulator's cache) and, when
asked, names a victim. The owner of the blocks decides which blocks may go at all (blocks in use by a
running request, or blocks that still have cached children, are not evictable) and passes that as the
``can_evict`` predicate; the policy picks among the rest by its own order.

The protocol lives in ``eviction_base``; each family has its own module: LRU here, ``eviction_s3fifo``,
``eviction_arc`` (both with libCacheSim's exact semantics) and ``eviction_prefix``, the prefix-aware
policy that is the default. Why it is the default, with the numbers: ``docs/eviction.md``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from types import MappingProxyType

from policies.eviction_arc import ARCPolicy
from policies.eviction_base import BlockId, BlockMeta, EvictionPolicy
from policies.eviction_prefix import PrefixAwarePolicy
from policies.eviction_s3fifo import S3FIFOPolicy

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "ARCPolicy",
    "BlockId",
    "BlockMeta",
    "EvictionPolicy",
    "LRUPolicy",
    "PrefixAwarePolicy",
    "S3FIFOPolicy",
    "make_policy",
]


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


POLICIES: Mapping[str, type[EvictionPolicy]] = MappingProxyType(
    {cls.name: cls for cls in (LRUPolicy, S3FIFOPolicy, ARCPolicy, PrefixAwarePolicy)}
)
DEFAULT_POLICY = "prefix"  # chosen by measurement: docs/eviction.md


def make_policy(name: str, capacity_blocks: int) -> EvictionPolicy:
    """Build a policy by registry name (``default`` is the worker's default)."""
    key = DEFAULT_POLICY if name == "default" else name
    try:
        return POLICIES[key](capacity_blocks)
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
