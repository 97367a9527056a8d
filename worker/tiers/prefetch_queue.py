"""The prefetch readers' queue: one FIFO per owner (tenant tag), the owners served in turn.

Every request with blocks only in L3 or Redis queues a prefetch, and each prefetch waits for its reads
(a Redis round trip can take a good part of the 250 ms timeout on a busy host). With one FIFO for all,
one tenant's burst of cold prompts queued every other tenant's request behind all of its reads (r2 #2:
0.21 s alone, 4.6 s during another tenant's 40-request burst). Here a tenant's prefetches wait only
behind its own; between tenants the readers take one each in turn (round robin), so another tenant
waits at most for the reads already in flight. The key is the tenant the gateway names, not the
namespace: every ``shared`` tenant hashes in the one global namespace.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Items queued per key, handed out one key at a time in turn; thread-safe."""

    def __init__(self) -> None:
        self._queues: OrderedDict[str, deque[T]] = OrderedDict()  # keys with items, in serving order
        self._cond = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._queues.values())

    def put(self, key: str, item: T) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the queue is closed")
            queue = self._queues.get(key)
            if queue is None:
                queue = self._queues[key] = deque()  # a new key is served after those already waiting
            queue.append(item)
            self._cond.notify()

    def get(self) -> T | None:
        """The next item (the oldest of the key whose turn it is), waiting for one; None once closed."""
        with self._cond:
            while not self._queues and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            key, queue = next(iter(self._queues.items()))
            item = queue.popleft()
            if queue:
                self._queues.move_to_end(key)  # its next item waits for every other key's turn
            else:
                del self._queues[key]
            return item

    def close(self) -> None:
        """Stop: waiting and later ``get`` calls return None; what was queued is dropped."""
        with self._cond:
            self._closed = True
            self._queues.clear()
            self._cond.notify_all()
