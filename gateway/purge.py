"""Purge fan-out: erase one namespace from every tier of every configured worker.

Every worker in ``worker_urls`` is asked (healthy or not: a worker the health check missed may still
hold blocks), concurrently, with ``POST /v1/purge``. The result lists each worker's answer and the
blocks erased per tier in total; ``complete`` is false when any worker could not be reached or failed,
and the admin API then answers 502 with the same body (a data-deletion request must never look done
when it is not; retrying is safe).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
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
    namespace_id: str
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
            "namespace_id": self.namespace_id,
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


async def purge_namespace(pool: WorkerPool, namespace_id: str, *, timeout_s: float) -> PurgeResult:
    async def one(url: str) -> WorkerPurge:
        try:
            erased = await pool.client(url).purge(namespace_id, timeout_s=timeout_s)
        except Exception as exc:  # unreachable, timed out, or an error answer: reported, not raised
            message = getattr(exc, "message", None) or str(exc) or exc.__class__.__name__
            return WorkerPurge(url=url, blocks_erased=None, error=f"{exc.__class__.__name__}: {message}")
        return WorkerPurge(url=url, blocks_erased=erased)

    results = await asyncio.gather(*(one(url) for url in pool.workers))
    return PurgeResult(namespace_id=namespace_id, workers=tuple(results))
