"""Purge fan-out: erase a tenant's namespaces from every tier of every configured worker.

A tenant may have several namespace ids: one per namespace secret still on record (a rotation changes
the id; blocks cached under the old one stay on the workers until purged). Every worker in
``worker_urls`` is asked (healthy or not: a worker the health check missed may still hold blocks),
concurrently, with ``POST /v1/purge`` for each id. The result lists each worker's answer and the
blocks erased per tier in total; ``complete`` is false when any worker could not be reached or failed,
and the admin API then answers 502 with the same body (a data-deletion request must never look done
when it is not; retrying is safe).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.workers import WorkerPool

TIERS = ("l1", "l2", "l3", "remote")


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerPurge:
    url: str
    blocks_erased: Mapping[str, int] | None  # None when the worker did not answer
    error: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class PurgeResult:
    namespace_ids: tuple[str, ...]  # the id in force first, then those of older namespace secrets
    workers: tuple[WorkerPurge, ...]

    @property
    def complete(self) -> bool:
        return all(worker.error is None for worker in self.workers)

    @property
    def blocks_erased(self) -> dict[str, int]:
        totals = dict.fromkeys(TIERS, 0)
        for worker in self.workers:
            for tier, count in (worker.blocks_erased or {}).items():
                totals[tier] = totals.get(tier, 0) + count
        return totals

    def to_json(self) -> dict[str, Any]:
        erased = self.blocks_erased
        return {
            "namespace_id": self.namespace_ids[0],
            "namespace_ids": list(self.namespace_ids),
            "complete": self.complete,
            "blocks_erased": erased,
            "total_blocks_erased": sum(erased.values()),
            "workers": [
                {
                    "url": worker.url,
                    "ok": worker.error is None,
                    "blocks_erased": dict(worker.blocks_erased) if worker.blocks_erased is not None else None,
                    "error": worker.error,
                }
                for worker in self.workers
            ],
        }


async def purge_namespaces(
    pool: WorkerPool, namespace_ids: Sequence[str], *, timeout_s: float
) -> PurgeResult:
    """Erase every id of ``namespace_ids`` on every worker (ids one after another on each worker)."""

    async def one(url: str) -> WorkerPurge:
        totals: dict[str, int] = {}
        for namespace_id in namespace_ids:
            try:
                erased = await pool.client(url).purge(namespace_id, timeout_s=timeout_s)
            except Exception as exc:  # unreachable, timed out, or an error answer: reported, not raised
                message = getattr(exc, "message", None) or str(exc) or exc.__class__.__name__
                return WorkerPurge(url=url, blocks_erased=None, error=f"{exc.__class__.__name__}: {message}")
            for tier, count in erased.items():
                totals[tier] = totals.get(tier, 0) + count
        return WorkerPurge(url=url, blocks_erased=totals)

    results = await asyncio.gather(*(one(url) for url in pool.workers))
    return PurgeResult(namespace_ids=tuple(namespace_ids), workers=tuple(results))
