"""The pool of workers: health checks, model discovery and in-flight accounting.

A background task polls every worker's ``/healthz``; a worker that answers for the first time, or with
a new ``worker_id`` (it restarted), has its ``/v1/info`` fetched again. Workers are grouped by model;
a worker whose fingerprint differs from the model's first worker is left out (it would hash differently).

A worker that stops answering ``/healthz`` within the health timeout twice in a row (hung, e.g.
SIGSTOPped), refuses
connections (dead) or says it is unhealthy is **lost**: no request is routed to it, and the requests
in flight on it end at once with 503 (``until_lost``) instead of waiting for the request timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import aiohttp

from gateway.errors import Unavailable
from gateway.model import ModelInfo, ModelRuntime
from gateway.routing import WorkerLoad
from gateway.upstream import WorkerClient

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class WorkerState:
    client: WorkerClient
    healthy: bool = False
    worker_id: str | None = None  # changes when the worker restarts
    model_id: str | None = None
    in_flight: int = 0  # requests this gateway has outstanding on it
    pending_prefill_tokens: int = 0  # of those, prompt tokens not yet prefilled (no first token yet)
    last_error: str | None = None
    lost: asyncio.Future[None] | None = None  # resolved when the worker is found hung or dead

    @property
    def url(self) -> str:
        return self.client.url

    def lost_future(self) -> asyncio.Future[None]:
        if self.lost is None or self.lost.done():
            self.lost = asyncio.get_running_loop().create_future()
        return self.lost

    def mark_lost(self, reason: str, *, end_requests: bool = True) -> None:
        """Stop routing here; with ``end_requests``, end the requests in flight (they wait in
        ``until_lost``). A dead worker (connection refused) needs no ending: its requests fail on their
        own, and those it never took are retried elsewhere; a hung one never answers them."""
        if self.healthy:
            log.warning("worker %s is unhealthy: %s", self.url, reason)
        self.healthy = False
        self.last_error = reason
        if end_requests and self.lost is not None and not self.lost.done():
            self.lost.set_result(None)


@dataclass(slots=True)
class ModelGroup:
    runtime: ModelRuntime
    worker_urls: list[str] = field(default_factory=list)


class WorkerPool:
    def __init__(
        self,
        urls: tuple[str, ...],
        session: aiohttp.ClientSession,
        *,
        timeout_s: float = 600.0,
        health_timeout_s: float = 5.0,
        kv_events_max_bytes: int = 16 << 20,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.workers = {
            url: WorkerState(
                WorkerClient(
                    url,
                    session,
                    timeout_s=timeout_s,
                    health_timeout_s=health_timeout_s,
                    kv_events_max_bytes=kv_events_max_bytes,
                )
            )
            for url in urls
        }
        self._models: dict[str, ModelGroup] = {}
        self._on_change = on_change

    @property
    def models(self) -> dict[str, ModelGroup]:
        """Models with at least one healthy worker."""
        return {
            model_id: group
            for model_id, group in self._models.items()
            if any(self.workers[url].healthy for url in group.worker_urls)
        }

    def known_model_ids(self) -> list[str]:
        """Every model a worker has reported, healthy or not."""
        return list(self._models)

    def model(self, model_id: str) -> ModelRuntime | None:
        group = self._models.get(model_id)
        return None if group is None else group.runtime

    def candidates(self, model_id: str) -> list[WorkerLoad]:
        group = self._models.get(model_id)
        if group is None:
            return []
        return [
            WorkerLoad(
                url=url,
                in_flight=self.workers[url].in_flight,
                pending_prefill_tokens=self.workers[url].pending_prefill_tokens,
            )
            for url in group.worker_urls
            if self.workers[url].healthy
        ]

    def client(self, url: str) -> WorkerClient:
        return self.workers[url].client

    async def check(self, state: WorkerState) -> None:
        """One health check. A healthy worker that times out gets one immediate second try (a busy host
        may answer late once); refused connections and errors count at once."""
        for attempt in (1, 2):
            try:
                await self._check_once(state)
                return
            except TimeoutError:
                if attempt == 1 and state.healthy:
                    continue
                state.mark_lost("no answer to /healthz in time (hung?)")
            except Exception as exc:
                reason = f"{exc.__class__.__name__}: {exc}" if str(exc) else exc.__class__.__name__
                state.mark_lost(reason, end_requests=not isinstance(exc, aiohttp.ClientConnectorError))
            return

    async def _check_once(self, state: WorkerState) -> None:
        health = await state.client.healthz()
        worker_id = health.get("worker_id")
        # /healthz may not carry the worker id: re-read /v1/info whenever the worker comes (back) up.
        restarted = worker_id is not None and worker_id != state.worker_id
        if state.model_id is None or not state.healthy or restarted:
            info = await state.client.info()
            self._attach(state, ModelInfo.from_json(info))
            state.worker_id = info.get("worker_id")
        state.healthy = state.model_id is not None
        state.last_error = None

    async def until_lost(self, state: WorkerState, awaitable: Awaitable[T], request_id: str) -> T:
        """Await a worker call unless the worker is lost first: then cancel it and raise 503."""
        lost = state.lost_future()
        task = asyncio.ensure_future(awaitable)
        try:
            await asyncio.wait((task, lost), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            # The call (often a generator's anext) must have ended before its generator can be closed.
            await asyncio.wait((task,))
            raise
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            raise Unavailable(
                f"the worker serving request {request_id} stopped answering ({state.last_error}); retry",
                code="worker_lost",
            )
        return task.result()

    def _attach(self, state: WorkerState, info: ModelInfo) -> None:
        group = self._models.get(info.model_id)
        if group is None:
            group = self._models[info.model_id] = ModelGroup(runtime=ModelRuntime(info))
        elif group.runtime.info.model_fingerprint != info.model_fingerprint:
            if group.worker_urls == [state.url]:
                group.runtime = ModelRuntime(info)  # the only worker was upgraded
            else:
                raise ValueError(f"fingerprint of {info.model_id!r} differs from the other workers'")
        for other in self._models.values():
            if state.url in other.worker_urls and other is not group:
                other.worker_urls.remove(state.url)
        if state.url not in group.worker_urls:
            group.worker_urls.append(state.url)
        state.model_id = info.model_id
        log.info(
            "worker %s serves %s (block size %d, context %d)",
            state.url,
            info.model_id,
            info.block_size,
            info.max_model_len,
        )
        if self._on_change is not None:
            self._on_change()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(state) for state in self.workers.values()))

    async def run(self, interval_s: float) -> None:
        """Health-check forever; faster while no worker is up (startup)."""
        while True:
            await self.check_all()
            healthy = any(state.healthy for state in self.workers.values())
            await asyncio.sleep(interval_s if healthy else min(interval_s, 0.2))

    def status(self) -> list[dict]:
        return [
            {
                "url": s.url,
                "healthy": s.healthy,
                "worker_id": s.worker_id,
                "model_id": s.model_id,
                "in_flight": s.in_flight,
                "last_error": s.last_error,
            }
            for s in self.workers.values()
        ]
