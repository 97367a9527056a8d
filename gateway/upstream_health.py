"""Health of an external upstream's URLs: a circuit breaker per URL, fed by the requests themselves
(passive) and, when ``probe_interval_s`` is set, by a ``GET /v1/models`` probe (active).

    closed ──(failure_threshold consecutive failures)──▶ open ──(cool-down, jittered)──▶ half-open
      ▲                                                   ▲                                │ one probe
      └───────────────────── success ◀────────────────────┴──────── failure ◀──────────────┘

A failure is what says the URL cannot take work whatever the request: a refused connection, a connect
timeout, or a probe not answered within its timeout. A tenant request that was sent and then timed out or
lost its connection is not one (a long generation is not a sick URL, and one tenant must not open a URL
for all); a hung server is found by the probe. Any HTTP answer (a 5xx included) is a success: the server
is there and said something. An open URL is skipped in the rendezvous order until its cool-down ends;
then one request at a time may try it (the half-open probe; another is let through if that one has not
reported within ``probe_window_s``). The cool-down is ``cooldown_s × U(1, 1 + jitter)`` so that
gateway replicas do not probe in lock-step.
When every URL is open the request tries them anyway (in rendezvous order): an outage of the whole
upstream is not made worse by refusing without asking.

Pure bookkeeping with an injectable clock and random source: no I/O here (the probe loop lives in
``gateway.upstream_openai``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass(slots=True)
class UrlHealth:
    failures: int = 0  # consecutive failures since the last success
    open_until: float = 0.0  # clock time until which the URL is skipped (0: closed)
    times_opened: int = 0  # for logs and tests
    last_error: str = ""  # the latest failure's kind


@dataclass(slots=True)
class CircuitBreaker:
    """Circuit breakers of one upstream's URLs."""

    urls: tuple[str, ...]
    failure_threshold: int = 2  # consecutive failures that open the breaker
    cooldown_s: float = 5.0  # how long an opened URL is skipped before a half-open probe
    jitter: float = 0.5  # cool-down × U(1, 1 + jitter)
    probe_window_s: float = 5.0  # a half-open probe that has not reported by then lets another through
    clock: Callable[[], float] = time.monotonic
    rng: Callable[[], float] = random.random
    _health: dict[str, UrlHealth] | None = None

    def __post_init__(self) -> None:
        self._health = {url: UrlHealth() for url in self.urls}

    def _of(self, url: str) -> UrlHealth:
        assert self._health is not None
        return self._health.setdefault(url, UrlHealth())

    def state(self, url: str) -> str:
        health = self._of(url)
        if health.failures < self.failure_threshold:
            return CLOSED
        return OPEN if self.clock() < health.open_until else HALF_OPEN

    def healthy(self, url: str) -> bool:
        """Closed (for metrics: open and half-open are not healthy)."""
        return self.state(url) == CLOSED

    def allow(self, url: str) -> bool:
        """May a request try ``url`` now? A half-open URL lets one through and stays shut to the
        others for ``probe_window_s`` (or until that one reports)."""
        state = self.state(url)
        if state == HALF_OPEN:
            self._of(url).open_until = self.clock() + self.probe_window_s
            return True
        return state == CLOSED

    def success(self, url: str) -> None:
        health = self._of(url)
        health.failures, health.open_until = 0, 0.0

    def failure(self, url: str, kind: str) -> bool:
        """Count a failure; True when it opened (or re-opened) the breaker."""
        health = self._of(url)
        health.failures += 1
        health.last_error = kind
        if health.failures < self.failure_threshold:
            return False
        health.open_until = self.clock() + self.cooldown_s * (1.0 + self.jitter * self.rng())
        health.times_opened += 1
        return True

    def snapshot(self) -> dict[str, dict[str, object]]:
        """State per URL, for the admin API and tests."""
        return {
            url: {
                "state": self.state(url),
                "consecutive_failures": self._of(url).failures,
                "times_opened": self._of(url).times_opened,
                "last_error": self._of(url).last_error or None,
            }
            for url in self.urls
        }
