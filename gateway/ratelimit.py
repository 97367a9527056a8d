"""Per-tenant request rate limit (requests per minute, per gateway replica): a sliding window."""

from __future__ import annotations

import time
from collections import deque


class RateLimiter:
    def __init__(self, *, window_s: float = 60.0) -> None:
        self._window_s = window_s
        self._hits: dict[str, deque[float]] = {}

    def allow(self, tenant_id: str, limit_per_window: int | None, now: float | None = None) -> bool:
        """Record a request and say whether it is within the limit (None: unlimited)."""
        if not limit_per_window:
            return True
        now = time.monotonic() if now is None else now
        hits = self._hits.setdefault(tenant_id, deque())
        while hits and hits[0] <= now - self._window_s:
            hits.popleft()
        if len(hits) >= limit_per_window:
            return False
        hits.append(now)
        return True
