"""A bounded pool of threads for the gateway's CPU work: rendering, canonicalization, tokenizing, hashing.

Run on the event loop, a 4 MB chat body stalled every tenant for seconds. Here the loop only waits:
at most ``num_threads`` jobs run at once and at most ``max_waiting`` more wait for a thread; past that
a request is refused at once with 503 and ``Retry-After`` (the gateway is saturated). The tokenizer
releases the GIL while it encodes, and pure-Python steps yield it every switch interval, so a big prompt
delays the others by milliseconds, not by its whole cost.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from gateway.errors import Unavailable

P = ParamSpec("P")
T = TypeVar("T")


class CpuPool:
    def __init__(self, *, num_threads: int = 4, max_waiting: int = 64) -> None:
        self._executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="gateway-cpu")
        self._slots = asyncio.Semaphore(num_threads)
        self._max_waiting = max_waiting
        self.num_waiting = 0

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

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
