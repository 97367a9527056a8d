"""Worker-side backpressure: a bounded queue of requests waiting for their first KV blocks.

The event loop enters a request before it reaches the engine; the engine thread lets it leave when the
scheduler admits it (or it ends before that). Beyond the bounds the worker answers 503 with Retry-After
at once instead of queueing without bound (docs/worker-api.md).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

MAX_RETRY_AFTER_S = 30


class Overloaded(RuntimeError):
    """The waiting queue is full: HTTP 503 with ``Retry-After: retry_after_s``."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(slots=True, kw_only=True)
class WaitingQueue:
    max_requests: int  # 0: no bound
    max_tokens: int  # prompt tokens of waiting requests; 0: no bound (one request is always let in)
    num_requests: int = 0
    num_tokens: int = 0
    num_rejected: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def check(self, num_tokens: int, *, drain_tokens_per_s: float) -> None:
        """Raise Overloaded if a request of ``num_tokens`` prompt tokens would not be let in now."""
        with self._lock:
            self._check(num_tokens, drain_tokens_per_s)

    def enter(self, num_tokens: int, *, drain_tokens_per_s: float) -> None:
        """Count a request in, or raise Overloaded (counted in ``num_rejected``)."""
        with self._lock:
            self._check(num_tokens, drain_tokens_per_s)
            self.num_requests += 1
            self.num_tokens += num_tokens

    def leave(self, num_tokens: int) -> None:
        with self._lock:
            self.num_requests -= 1
            self.num_tokens -= num_tokens

    def _check(self, num_tokens: int, drain_tokens_per_s: float) -> None:
        full_requests = self.max_requests and self.num_requests >= self.max_requests
        full_tokens = self.max_tokens and self.num_requests and self.num_tokens + num_tokens > self.max_tokens
        if not (full_requests or full_tokens):
            return
        self.num_rejected += 1
        wait_s = self.num_tokens / drain_tokens_per_s if drain_tokens_per_s > 0 else MAX_RETRY_AFTER_S
        raise Overloaded(
            f"worker overloaded: {self.num_requests} requests ({self.num_tokens} prompt tokens) are waiting",
            retry_after_s=min(MAX_RETRY_AFTER_S, max(1, math.ceil(wait_s))),
        )
