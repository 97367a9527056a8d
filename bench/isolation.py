"""How a trace looks to the cache under each isolation level (DESIGN.md, "Isolation levels").

- ``shared``: one pool, one namespace: equal block ids are shared by every tenant.
- ``namespace``: one pool, but every tenant hashes in its own namespace, so a block id is shared only
  within a tenant (public prompts are no longer shared across tenants).
- ``dedicated``: per-tenant namespaces and a reserved quota per tenant: the capacity is split into one
  partition per tenant, proportional to the tenant's share of requested blocks (the split an operator
  would reserve knowing the load; an equal split does worse), each with its own policy object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.replay import ReplayRequest
from bench.trace import TraceRequest
from policies.eviction import BlockId

ISOLATION_LEVELS = ("shared", "namespace", "dedicated")


@dataclass(frozen=True, kw_only=True, slots=True)
class Partition:
    """One cache of the replay: the requests it serves and its size."""

    requests: tuple[ReplayRequest, ...]
    capacity_blocks: int
    namespace_id: str  # the tenant of a dedicated partition, "" for a common pool


def partitions(requests: Sequence[TraceRequest], isolation: str, capacity_blocks: int) -> list[Partition]:
    """The caches that serve ``requests`` under ``isolation``, with ``capacity_blocks`` in total.

    Raises ValueError for an unknown isolation level.
    """
    if isolation not in ISOLATION_LEVELS:
        raise ValueError(f"unknown isolation {isolation!r}; known: {', '.join(ISOLATION_LEVELS)}")
    if isolation == "shared":
        stream = tuple(
            ReplayRequest(now_s=r.timestamp_ms / 1000.0, block_ids=_as_block_ids(r.hash_ids), namespace_id="")
            for r in requests
        )
        return [Partition(requests=stream, capacity_blocks=capacity_blocks, namespace_id="")]
    stream = _namespaced(requests)
    if isolation == "namespace":
        return [Partition(requests=stream, capacity_blocks=capacity_blocks, namespace_id="")]
    by_tenant: dict[str, list[ReplayRequest]] = {}
    for request in stream:
        by_tenant.setdefault(request.namespace_id, []).append(request)
    demand = {tenant: sum(len(r.block_ids) for r in reqs) for tenant, reqs in by_tenant.items()}
    quotas = split_capacity(capacity_blocks, demand)
    return [
        Partition(requests=tuple(reqs), capacity_blocks=quotas[tenant], namespace_id=tenant)
        for tenant, reqs in sorted(by_tenant.items())
    ]


def split_capacity(capacity_blocks: int, demand: dict[str, int]) -> dict[str, int]:
    """Whole-block quotas proportional to ``demand`` that sum to ``capacity_blocks`` (largest remainder)."""
    total = sum(demand.values())
    if total == 0:
        return dict.fromkeys(demand, 0)
    exact = {tenant: capacity_blocks * d / total for tenant, d in demand.items()}
    quotas = {tenant: int(share) for tenant, share in exact.items()}
    leftover = capacity_blocks - sum(quotas.values())
    by_remainder = sorted(exact, key=lambda tenant: (quotas[tenant] - exact[tenant], tenant))
    for tenant in by_remainder[:leftover]:
        quotas[tenant] += 1
    return quotas


def _as_block_ids(hash_ids: tuple[int, ...]) -> tuple[BlockId, ...]:
    return tuple(BlockId(h) for h in hash_ids)


def _namespaced(requests: Sequence[TraceRequest]) -> tuple[ReplayRequest, ...]:
    """Requests with block ids renumbered per (tenant, hash id): namespaces never share a block."""
    ids: dict[tuple[str, int], BlockId] = {}
    stream = []
    for r in requests:
        block_ids = tuple(ids.setdefault((r.tenant, h), BlockId(len(ids))) for h in r.hash_ids)
        stream.append(
            ReplayRequest(now_s=r.timestamp_ms / 1000.0, block_ids=block_ids, namespace_id=r.tenant)
        )
    return tuple(stream)
