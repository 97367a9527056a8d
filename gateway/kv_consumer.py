"""Follows every worker's KV-event stream into the gateway's ``PrefixIndex``.

One task per worker long-polls ``GET /v1/kv_events?since=<last applied seq>``: after a broken
connection it resumes from the last event it applied (the worker replays the rest). A worker whose
stream fails is dropped from the index at once, so no request is routed for a cache that died with
it; a restarted worker (new ``worker_id``) is read again from its first event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from gateway.kv_index import PrefixIndex
from gateway.workers import WorkerPool

log = logging.getLogger(__name__)


class KVEventConsumer:
    def __init__(
        self, pool: WorkerPool, index: PrefixIndex, *, wait_ms: int = 1000, retry_s: float = 0.5
    ) -> None:
        self._pool = pool
        self._index = index
        self._wait_ms = wait_ms
        self._retry_s = retry_s
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._follow(url), name=f"kv-events {url}") for url in self._pool.workers
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _follow(self, url: str) -> None:
        client = self._pool.client(url)
        failing = False
        while True:
            worker_id, since = self._index.position(url)
            try:
                batch = await client.kv_events(since=since, wait_ms=self._wait_ms)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not failing:
                    log.info("KV events of %s unavailable (%s): dropped from the routing index", url, exc)
                failing = True
                self._index.drop(url)
                await asyncio.sleep(self._retry_s)
                continue
            failing = False
            if worker_id is not None and batch["worker_id"] != worker_id and since > 0:
                self._index.drop(url)  # restarted: read the new process from its first event
                continue
            self._index.apply(url, batch)
