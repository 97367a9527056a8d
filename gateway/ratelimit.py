"""Per-tenant request rate limits (requests per minute).

``LocalRateLimiter`` counts in this process (a sliding window): with several gateway replicas each one
allows the full rate. ``RedisRateLimiter`` shares a fixed one-minute window between replicas through
Redis (``INCR`` + ``EXPIRE`` in one round trip, only for tenants that have a limit) and falls back to
the local limiter while Redis is unreachable.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Protocol

log = logging.getLogger(__name__)

WINDOW_S = 60.0


class RateLimiter(Protocol):
    async def allow(self, tenant_id: str, limit_per_window: int | None) -> bool:
        """Record a request and say whether it is within the limit (None or 0: unlimited)."""
        ...

    async def close(self) -> None: ...


class LocalRateLimiter:
    def __init__(self, *, window_s: float = WINDOW_S) -> None:
        self._window_s = window_s
        self._hits: dict[str, deque[float]] = {}

    def allow_at(self, tenant_id: str, limit_per_window: int | None, now: float) -> bool:
        if not limit_per_window:
            return True
        hits = self._hits.setdefault(tenant_id, deque())
        while hits and hits[0] <= now - self._window_s:
            hits.popleft()
        if len(hits) >= limit_per_window:
            return False
        hits.append(now)
        return True

    async def allow(self, tenant_id: str, limit_per_window: int | None) -> bool:
        return self.allow_at(tenant_id, limit_per_window, time.monotonic())

    async def close(self) -> None:
        return None


class RedisRateLimiter:
    def __init__(self, redis_url: str, *, key_prefix: str = "prefixgate:ratelimit") -> None:
        import redis.asyncio as redis

        self._redis = redis.from_url(redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)
        self._prefix = key_prefix
        self._fallback = LocalRateLimiter()

    async def allow(self, tenant_id: str, limit_per_window: int | None) -> bool:
        if not limit_per_window:
            return True
        window = int(time.time() // WINDOW_S)
        key = f"{self._prefix}:{tenant_id}:{window}"
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                count, _ = await pipe.incr(key).expire(key, int(2 * WINDOW_S)).execute()
        except Exception as exc:  # Redis down: keep limiting, per replica
            log.warning("rate limiter: Redis unreachable, limiting locally: %s", exc)
            return await self._fallback.allow(tenant_id, limit_per_window)
        return int(count) <= limit_per_window

    async def close(self) -> None:
        await self._redis.aclose()
