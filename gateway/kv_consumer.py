"""Follows every worker's KV-event stream into the gateway's ``PrefixIndex``.

One task per worker long-polls ``GET /v1/kv_events?since=<last applied seq>``: after a broken
connection it resumes from the last event it applied (the worker replays the rest). A worker whose
stream fails is dropped from the index at once, so no request is routed for a cache that died with
it; a restarted worker (new ``worker_id``) is read again from its first event. A worker whose ring
no longer holds the events after that answers with a snapshot of its state in pages, asked for one
after another (``snapshot=<cursor>``), then the events after the snapshot (``worker.kv_events``).
A malformed batch, or an answer over ``kv_events_max_bytes`` (read no further), drops the worker from
the index the same way (logged, counted in ``prefixgate_kv_event_batches_refused_total``).

With a ``RedisKVRelay`` (several replicas) only the replica holding a worker's lease polls it and
publishes what it applies; the others apply the published batches (``gateway.kv_relay``). If Redis
fails, each replica polls the worker itself until Redis answers again. A relayed batch is applied from
where the replica is: events it applied already are skipped (its own catch-up, a batch it polled itself
as leader just before the lease passed on), and a batch that starts past its next sequence number (one
never published: the stream trimmed, a leader's Redis error) makes it poll the worker itself until it is
caught up, then go on with the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from gateway.kv_index import PrefixIndex
from gateway.kv_relay import RedisKVRelay
from gateway.metrics import GatewayMetrics
from gateway.upstream import KVEventsTooLarge
from gateway.workers import WorkerPool

log = logging.getLogger(__name__)
MAX_CATCH_UP_POLLS = 64  # a replica filling a gap in the relayed stream polls the worker at most this often


class _Gap(Exception):
    """A relayed batch starts past the replica's next sequence number: events were never relayed."""


def relayed_part(batch: Any, worker_id: str | None, last_seq: int) -> Any | None:
    """What of a relayed ``batch`` continues a replica at (``worker_id``, ``last_seq``): the batch itself
    when it resets or pages the worker's state or carries no events, else its events after ``last_seq``
    (the sequence starts again at 1 for another worker process); None when all of them were applied.
    Raises _Gap when its first event is past ``last_seq + 1``. A malformed batch is returned as it is:
    ``KVEventConsumer._apply`` refuses it."""
    if not isinstance(batch, dict) or batch.get("reset") or batch.get("snapshot") is not None:
        return batch
    events = batch.get("events")
    if not isinstance(events, list) or not events:
        return batch
    try:
        seqs = [int(event["seq"]) for event in events]
    except (KeyError, TypeError, ValueError):
        return batch
    applied = last_seq if worker_id is not None and batch.get("worker_id") == worker_id else 0
    if seqs[0] > applied + 1:
        raise _Gap
    fresh = [event for event, seq in zip(events, seqs, strict=True) if seq > applied]
    if not fresh:
        return None
    return batch if len(fresh) == len(events) else {**batch, "events": fresh}


class KVEventConsumer:
    def __init__(
        self,
        pool: WorkerPool,
        index: PrefixIndex,
        *,
        relay: RedisKVRelay | None = None,
        wait_ms: int = 1000,
        retry_s: float = 0.5,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self._index = index
        self._relay = relay
        self._wait_ms = wait_ms
        self._retry_s = retry_s
        self._tasks: list[asyncio.Task] = []
        self.leading: set[str] = set()  # workers this replica polls itself (holds the relay lease)
        self.num_relayed_batches = 0  # batches applied from other replicas through Redis
        self.num_malformed_batches = 0  # batches refused (the worker was dropped from the index instead)
        self.num_relay_gaps = 0  # relayed batches that started past this replica's position (it polled)

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._follow(url), name=f"kv-events {url}") for url in self._pool.workers
        ]

    async def close(self, timeout_s: float = 2.0) -> None:
        """Stop following; bounded, so a Redis or worker call that ignores its cancellation cannot hold
        the gateway's shutdown (``asyncio.wait`` returns at its timeout, ``wait_for`` would not)."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=timeout_s)
            if pending:
                log.warning("KV-event followers still running at close: %s", [t.get_name() for t in pending])
        if self._relay is not None:
            steps = [self._relay.release(url) for url in list(self.leading)]
            for step in [*steps, self._relay.close()]:
                task = asyncio.ensure_future(step)
                done, _ = await asyncio.wait({task}, timeout=timeout_s)
                if not done:
                    task.cancel()
                elif task.exception() is not None:
                    log.info("KV-event relay close: %s", task.exception())

    async def _poll(self, url: str) -> dict[str, Any] | None:
        """One long poll of the worker, applied to the index; None (and the worker dropped) on failure."""
        while True:
            worker_id, since = self._index.position(url)
            cursor = self._index.snapshot_cursor(url)
            try:
                batch = await self._pool.client(url).kv_events(
                    since=since, wait_ms=self._wait_ms, snapshot=cursor
                )
            except asyncio.CancelledError:
                raise
            except KVEventsTooLarge as exc:
                log.warning("%s from %s: dropped from the routing index", exc, url)
                self._refused("too_large")
                self._index.drop(url)
                return None
            except Exception as exc:
                if url in self._index.workers:
                    log.info("KV events of %s unavailable (%s): dropped from the routing index", url, exc)
                self._index.drop(url)
                return None
            try:
                if worker_id is not None and batch["worker_id"] != worker_id and since > 0:
                    self._index.drop(url)  # restarted: read the new process from its first event
                    continue
            except (KeyError, TypeError):
                pass  # malformed: _apply refuses it
            return batch if self._apply(url, batch) else None

    def _apply(self, url: str, batch: Any) -> bool:
        """Apply one batch; a malformed one (a broken or hostile worker) drops the worker from the index
        instead of ending this worker's consumer task, so routing never keeps its stale blocks."""
        try:
            self._index.apply(url, batch)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            log.warning("malformed KV-event batch from %s (%r): dropped from the routing index", url, exc)
            self._index.drop(url)
            self.num_malformed_batches += 1
            self._refused("malformed")
            return False
        return True

    def _refused(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.kv_event_batches_refused.labels(reason).inc()

    async def _follow(self, url: str) -> None:
        if self._relay is None:
            while True:
                if await self._poll(url) is None:
                    await asyncio.sleep(self._retry_s)
        last_id = "0"
        while True:
            try:
                leading = await self._relay.lead(url)
                if not leading:
                    self.leading.discard(url)
                    last_id = await self._apply_relayed(url, last_id, block_ms=self._wait_ms)
                    continue
                if url not in self.leading:  # just took over: catch up with what the last leader published
                    self.leading.add(url)
                    last_id = await self._apply_relayed(url, last_id, block_ms=None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis is down: follow the worker directly meanwhile
                log.warning("KV-event relay unavailable (%s): polling %s directly", exc, url)
                if await self._poll(url) is None:
                    await asyncio.sleep(self._retry_s)
                continue
            batch = await self._poll(url)
            with contextlib.suppress(Exception):
                entry_id = await self._relay.publish(url, batch if batch is not None else {"dropped": True})
                if entry_id is None:  # the lease passed on while this poll ran: read what the leader sent
                    self.leading.discard(url)
                else:
                    last_id = entry_id
            if batch is None:
                await asyncio.sleep(self._retry_s)

    async def _apply_relayed(self, url: str, last_id: str, *, block_ms: int | None) -> str:
        while True:
            entries = await self._relay.read(url, last_id, block_ms=block_ms)  # type: ignore[union-attr]
            for entry_id, batch in entries:
                if batch.get("dropped"):
                    self._index.drop(url)
                else:
                    await self._apply_relayed_batch(url, batch)
                last_id = entry_id
            if block_ms is not None or not entries:
                return last_id

    async def _apply_relayed_batch(self, url: str, batch: Any) -> None:
        """Apply the part of a relayed batch this replica lacks; after a gap, poll the worker first."""
        try:
            part = relayed_part(batch, *self._index.position(url))
        except _Gap:
            self.num_relay_gaps += 1
            log.info("KV events of %s: a relayed batch skips events, polling the worker to catch up", url)
            if not await self._catch_up(url):
                return
            try:
                part = relayed_part(batch, *self._index.position(url))
            except _Gap:  # e.g. the worker restarted meanwhile: the batch is of its old process
                return
        if part is not None and self._apply(url, part):
            self.num_relayed_batches += 1

    async def _catch_up(self, url: str) -> bool:
        """Poll the worker until this replica has applied every event it has (snapshot pages included);
        False when the worker did not answer (it was dropped from the index)."""
        for _ in range(MAX_CATCH_UP_POLLS):
            batch = await self._poll(url)
            if batch is None:
                return False
            state = self._index.workers.get(url)
            if state is not None and state.caught_up:
                return True
        return False
