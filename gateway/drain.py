"""Graceful shutdown: whether the gateway is draining, so that a request cut by the stop is recorded as
``shutdown`` (not as the client's doing) and billed what it delivered.

Order on SIGTERM (aiohttp's runner): stop listening → ``on_shutdown`` (``Drain.start``) → wait up to
``shutdown_grace_s`` for requests in flight → cancel the rest (their records say ``shutdown``) →
cleanup, which flushes usage records (bounded by ``usage_db_timeout_s``, else to the spool).
Keep ``shutdown_grace_s`` + ``usage_db_timeout_s`` + a few seconds under the container's stop grace
period (docker/compose.yaml ``stop_grace_period``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Drain:
    grace_s: float
    started_monotonic: float | None = None

    @property
    def started(self) -> bool:
        return self.started_monotonic is not None

    def start(self) -> None:
        if self.started_monotonic is None:
            self.started_monotonic = time.monotonic()
            log.info("draining: requests in flight get %.0f s to finish", self.grace_s)


def on_shutdown(drain: Drain) -> Callable[[web.Application], Awaitable[None]]:
    """The ``app.on_shutdown`` hook that starts the drain (aiohttp calls it once listening stopped)."""

    async def handler(_app: web.Application) -> None:
        drain.start()

    return handler
