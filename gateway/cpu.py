"""A bounded pool of threads for the gateway's CPU work: rendering, canonicalization, tokenizing, hashing.

Run on the event loop, a 4 MB chat body stalled every tenant for seconds. Here the loop only waits:
at most ``num_threads`` jobs run at once and at most ``max_waiting`` more wait for a thread; past that
a request is refused at once with 503 and ``Retry-After`` (the gateway is saturated). The tokenizer
releases the GIL while it encodes, and pure-Python steps yield it every switch interval, so a big prompt
delays the others by milliseconds, not by its whole cost.

The pool is shared fairly between tenants (``run_for``): one owner holds at most ``per_owner`` threads
(half the pool by default) and has at most ``per_owner_waiting`` (``max_waiting``) more jobs waiting for
them. An owner's
jobs past its share wait for its *own* threads, so they neither take a thread nor a place in the common
queue that another tenant needs; past its own queue the owner gets 429 (its requests, not the gateway,
are what is busy). Without this, four 1 MB prompts of one tenant on a 4-thread pool made another
tenant's one-token chat wait 30 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from gateway.errors import RateLimited, Unavailable

P = ParamSpec("P")
T = TypeVar("T")


class _Share:
    """One owner's threads: a semaphore and how many of its jobs hold or wait for it."""

    def __init__(self, num_threads: int) -> None:
        self.slots = asyncio.Semaphore(num_threads)
        self.num_users = 0


class CpuPool:
    def __init__(
        self,
        *,
        num_threads: int = 4,
        max_waiting: int = 64,
        per_owner: int | None = None,
        per_owner_waiting: int | None = None,
    ) -> None:
        self._executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="gateway-cpu")
        self._slots = asyncio.Semaphore(num_threads)
        self._max_waiting = max_waiting
        self.num_waiting = 0
        self.per_owner = per_owner or max(1, num_threads // 2)
        self.per_owner_waiting = per_owner_waiting or max_waiting
        self._shares: dict[str, _Share] = {}

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on a pool thread; raises ``Unavailable`` when too many wait."""
        if self._slots.locked() and self.num_waiting >= self._max_waiting:
            raise Unavailable(
                "the gateway is busy preparing other prompts; retry shortly", code="server_busy"
            )
        self.num_waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.num_waiting -= 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))
        finally:
            self._slots.release()

    async def run_for(self, owner: str, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a pool thread within ``owner``'s share (a tenant id)."""
        async with self._share(owner):
            return await self.run(fn, *args)

    @contextlib.asynccontextmanager
    async def _share(self, owner: str) -> AsyncIterator[None]:
        share = self._shares.get(owner)
        if share is None:
            share = self._shares[owner] = _Share(self.per_owner)
        if share.num_users >= self.per_owner + self.per_owner_waiting:
            raise RateLimited(
                f"too many of your prompts are being prepared at once (at most {self.per_owner} run and "
                f"{self.per_owner_waiting} wait); retry shortly",
                code="too_many_prompts_in_preparation",
            )
        share.num_users += 1
        try:
            async with share.slots:
                yield
        finally:
            share.num_users -= 1
            if share.num_users == 0:
                del self._shares[owner]

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
