"""Per-tenant rate limits: requests per minute and tokens per minute.

``LocalRateLimiter`` counts in this process (a weighted sliding window): with several gateway replicas
each one allows the full rate. ``RedisRateLimiter`` shares a fixed one-minute window between replicas
through Redis (one Lua script that counts a check only if it fits: one round trip, only for tenants that
have a limit). While Redis fails or hangs it limits locally and **pauses** Redis for ``pause_s`` after an
error (like the hot-prefix counters), so a hung Redis costs one short timeout per pause, not one per
request.

Each check answers a ``RateDecision`` that carries what the ``x-ratelimit-*`` headers report and where
the check counted (``Counted``). ``refund`` gives back units counted for a request that was refused later
(a request with ``n`` choices counts one request on arrival and ``n - 1`` more once its body is read:
refused then, it counts nothing), or that a check over-estimated; ``charge`` counts units a check
under-estimated (an external upstream's prompt is checked at characters / 4, then corrected with the
tokens the upstream reports, at the end of its stream: gateway.upstream_serve).

Windows (review r8 #4): a stream checked in one minute may end minutes later. A refund goes back where
its check counted, and only while that still limits anything: into the check's Redis window while it is
the current one, onto the check's own local hit while it is inside the sliding window; otherwise it is
skipped (the units it would free were never counted where the requests that follow are checked; freeing
them there let a tenant past its limit). A charge always lands, in the current window (Redis) or as a hit
at the current time (local): its units were used by a request that ran until now, and a window that has
passed can refuse nothing any more. So a charge may count a little longer than the request's own check,
never shorter.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

WINDOW_S = 60.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Counted:
    """Where an allowed check counted its units: ``refund`` gives them back there, or nowhere."""

    window: int | None = None  # RedisRateLimiter: the fixed window's number, int(time.time() // WINDOW_S)
    local_s: float | None = None  # LocalRateLimiter: the time of the check's hit (time.monotonic())


@dataclass(frozen=True, kw_only=True, slots=True)
class RateDecision:
    """One limit checked for one request."""

    allowed: bool
    limit: int | None  # None: unlimited
    remaining: int  # what is left in the window after this request (0 when refused)
    reset_s: float  # seconds until the window frees enough room (0 when nothing is used)
    counted: Counted | None = None  # None: nothing counted (refused, or unlimited)

    @classmethod
    def unlimited(cls) -> RateDecision:
        return cls(allowed=True, limit=None, remaining=0, reset_s=0.0)

    def headers(self, kind: str) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{kind}`` (kind: requests or tokens)."""
        if self.limit is None:
            return {}
        return {
            f"x-ratelimit-limit-{kind}": str(self.limit),
            f"x-ratelimit-remaining-{kind}": str(self.remaining),
            f"x-ratelimit-reset-{kind}": format_reset(self.reset_s),
        }

    @property
    def retry_after_s(self) -> int:
        return max(1, math.ceil(self.reset_s))


class RateLimiter(Protocol):
    async def check(self, key: str, limit_per_window: int | None, cost: int = 1) -> RateDecision:
        """Count ``cost`` units for ``key`` if they fit in the limit (None or 0: unlimited)."""
        ...

    async def refund(self, key: str, cost: int, counted: Counted | None) -> None:
        """Give back up to ``cost`` units that the allowed check of ``key`` answering ``counted`` counted,
        where it counted them, if that window still limits anything; else nothing (never below zero)."""
        ...

    async def charge(self, key: str, cost: int) -> None:
        """Count ``cost`` more units for ``key`` in the current window without refusing (past the limit
        too): what an allowed request used beyond its check. The requests that follow are refused on them."""
        ...

    async def close(self) -> None: ...


class LocalRateLimiter:
    def __init__(self, *, window_s: float = WINDOW_S) -> None:
        self._window_s = window_s
        self._hits: dict[str, deque[tuple[float, int]]] = {}
        self._used: dict[str, int] = {}

    def check_at(self, key: str, limit_per_window: int | None, cost: int, now: float) -> RateDecision:
        if not limit_per_window:
            return RateDecision.unlimited()
        hits = self._hits.setdefault(key, deque())
        used = self._used.get(key, 0)
        while hits and hits[0][0] <= now - self._window_s:
            used -= hits.popleft()[1]
        reset_s = (hits[0][0] + self._window_s - now) if hits else 0.0
        if used + cost > limit_per_window:
            self._used[key] = used
            # A request larger than the whole limit never fits: report a full window.
            return RateDecision(
                allowed=False, limit=limit_per_window, remaining=0, reset_s=reset_s or self._window_s
            )
        hits.append((now, cost))
        self._used[key] = used + cost
        return RateDecision(
            allowed=True,
            limit=limit_per_window,
            remaining=limit_per_window - used - cost,
            reset_s=reset_s or self._window_s,
            counted=Counted(local_s=now),
        )

    def allow_at(self, key: str, limit_per_window: int | None, now: float) -> bool:
        return self.check_at(key, limit_per_window, 1, now).allowed

    def refund_at(self, key: str, cost: int, counted: Counted | None, now: float) -> None:
        """Take up to ``cost`` units off the check's own hit (at ``counted.local_s``), not off others'
        (they leave the window later), unless it has left the window already."""
        hits = self._hits.get(key)
        if not hits or counted is None or counted.local_s is None or counted.local_s <= now - self._window_s:
            return
        for index in range(len(hits) - 1, -1, -1):  # newest first: the check is recent
            at, units = hits[index]
            if at < counted.local_s or cost <= 0:
                break
            if at == counted.local_s:
                taken = min(units, cost)
                cost -= taken
                self._used[key] -= taken
                if units > taken:
                    hits[index] = (at, units - taken)
                else:
                    del hits[index]

    async def refund(self, key: str, cost: int, counted: Counted | None) -> None:
        self.refund_at(key, cost, counted, time.monotonic())

    async def charge(self, key: str, cost: int) -> None:
        if cost > 0:
            self._hits.setdefault(key, deque()).append((time.monotonic(), cost))
            self._used[key] = self._used.get(key, 0) + cost

    async def check(self, key: str, limit_per_window: int | None, cost: int = 1) -> RateDecision:
        return self.check_at(key, limit_per_window, cost, time.monotonic())

    async def close(self) -> None:
        return None


class RedisRateLimiter:
    def __init__(
        self,
        redis_url: str,
        *,
        key_prefix: str = "prefixgate:ratelimit",
        timeout_s: float = 0.25,
        pause_s: float = 5.0,
    ) -> None:
        import redis.asyncio as redis

        self._redis = redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._prefix = key_prefix
        self._fallback = LocalRateLimiter()
        self._pause_s = pause_s
        self._paused_until = 0.0  # time.monotonic()
        self.num_errors = 0

    @property
    def paused(self) -> bool:
        return time.monotonic() < self._paused_until

    async def check(self, key: str, limit_per_window: int | None, cost: int = 1) -> RateDecision:
        if not limit_per_window:
            return RateDecision.unlimited()
        if self.paused:
            return await self._fallback.check(key, limit_per_window, cost)
        now = time.time()
        window = int(now // WINDOW_S)
        redis_key = f"{self._prefix}:{key}:{window}"
        try:
            count = int(
                await self._redis.eval(_CHECK_LUA, 1, redis_key, cost, limit_per_window, int(2 * WINDOW_S))
            )
        except Exception as exc:  # Redis down or hung: limit locally and leave Redis alone a while
            self.num_errors += 1
            log.warning("rate limiter: Redis unavailable, limiting locally for %.0fs: %s", self._pause_s, exc)
            self._paused_until = time.monotonic() + self._pause_s
            return await self._fallback.check(key, limit_per_window, cost)
        reset_s = (window + 1) * WINDOW_S - now
        allowed = count <= limit_per_window
        remaining = max(0, limit_per_window - count) if allowed else 0
        counted = Counted(window=window) if allowed else None
        return RateDecision(
            allowed=allowed, limit=limit_per_window, remaining=remaining, reset_s=reset_s, counted=counted
        )

    async def refund(self, key: str, cost: int, counted: Counted | None) -> None:
        if counted is None:
            return
        if counted.window is None:  # counted locally while Redis was paused
            await self._fallback.refund(key, cost, counted)
            return
        if counted.window != int(time.time() // WINDOW_S) or self.paused:
            return  # a window that has passed limits nothing any more; paused: an over-count, never an error
        redis_key = f"{self._prefix}:{key}:{counted.window}"
        try:
            await self._redis.eval(_REFUND_LUA, 1, redis_key, cost)  # never below zero
        except Exception as exc:  # an over-count for the rest of this window, never an error for the client
            self.num_errors += 1
            log.warning("rate limiter: Redis unavailable, refund of %d for %s lost: %s", cost, key, exc)
            self._paused_until = time.monotonic() + self._pause_s

    async def charge(self, key: str, cost: int) -> None:
        if cost <= 0:
            return
        if self.paused:
            await self._fallback.charge(key, cost)
            return
        redis_key = f"{self._prefix}:{key}:{int(time.time() // WINDOW_S)}"
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                await pipe.incrby(redis_key, cost).expire(redis_key, int(2 * WINDOW_S)).execute()
        except Exception as exc:  # counted here, for the pause (the other replicas do not see it)
            self.num_errors += 1
            log.warning("rate limiter: Redis unavailable, limiting locally for %.0fs: %s", self._pause_s, exc)
            self._paused_until = time.monotonic() + self._pause_s
            await self._fallback.charge(key, cost)

    async def close(self) -> None:
        await self._redis.aclose()


# Counts ``cost`` only if it fits, in one atomic step: a refused check counts nothing, like the local
# limiter's (review r6: a refused single unit kept counted refused a later request the limit allows), and
# never shows an over-count to a concurrent check. Answers the count with this check's cost either way.
_CHECK_LUA = """
local cost = tonumber(ARGV[1])
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
if used + cost > tonumber(ARGV[2]) then return used + cost end
local count = redis.call('INCRBY', KEYS[1], cost)
redis.call('EXPIRE', KEYS[1], ARGV[3])
return count
"""

_REFUND_LUA = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local cost = tonumber(ARGV[1])
if used >= cost then return redis.call('DECRBY', KEYS[1], cost) end
return used
"""


def requests_key(tenant_id: str) -> str:
    """The limiter key of a tenant's requests per minute."""
    return f"r:{tenant_id}"


def tokens_key(tenant_id: str) -> str:
    """The limiter key of a tenant's tokens per minute."""
    return f"t:{tenant_id}"


def format_reset(reset_s: float) -> str:
    """OpenAI's ``x-ratelimit-reset-*`` format: ``1s``, ``6m0s``, ``20ms``."""
    if reset_s < 1:
        return f"{max(0, math.ceil(reset_s * 1000))}ms"
    seconds = math.ceil(reset_s)
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"
