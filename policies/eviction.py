"""Eviction policies over block ids: pure objects picked from a registry.

A policy tracks the blocks resident in one cache (one tier's pool, or the simulator's cache) and, when
asked, names a victim. The owner of the blocks decides which blocks may go at all (blocks in use by a
running request, or blocks that still have cached children, are not evictable) and passes that as the
``can_evict`` predicate; the policy picks among the rest by its own order.

The protocol lives in ``eviction_base``; each family has its own module: ``eviction_lru``,
``eviction_s3fifo``, ``eviction_arc`` (both with libCacheSim's exact semantics), ``eviction_prefix`` (the
prefix-aware policy) and ``eviction_adaptive``, the default, which follows whichever of prefix / ARC /
LRU is winning on the workload. Why, with the numbers: ``docs/eviction.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from policies.eviction_adaptive import AdaptivePolicy
from policies.eviction_arc import ARCPolicy
from policies.eviction_base import BlockId, BlockMeta, EvictionPolicy
from policies.eviction_lru import LRUPolicy
from policies.eviction_prefix import PrefixAwarePolicy
from policies.eviction_s3fifo import S3FIFOPolicy

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "ARCPolicy",
    "AdaptivePolicy",
    "BlockId",
    "BlockMeta",
    "EvictionPolicy",
    "LRUPolicy",
    "PrefixAwarePolicy",
    "S3FIFOPolicy",
    "make_policy",
]


POLICIES: Mapping[str, type[EvictionPolicy]] = MappingProxyType(
    {cls.name: cls for cls in (LRUPolicy, S3FIFOPolicy, ARCPolicy, PrefixAwarePolicy, AdaptivePolicy)}
)
DEFAULT_POLICY = "adaptive"  # chosen by measurement: docs/eviction.md


def make_policy(name: str, capacity_blocks: int) -> EvictionPolicy:
    """Build a policy by registry name (``default`` is the worker's default)."""
    key = DEFAULT_POLICY if name == "default" else name
    try:
        return POLICIES[key](capacity_blocks)
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
