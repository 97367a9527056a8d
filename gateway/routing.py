"""Worker routing: pure decision objects picked from a registry.

The request's affinity key is derived inside its namespace (a block hash of the first blocks of the
prompt, or the tenant's ``prompt_cache_key`` mixed with its namespace key), so two tenants never
collide on purpose and one tenant's prompts with the same head land on the same worker, where its
blocks are cached. A later KV-event router (longest cached prefix per worker) implements the same
``Router`` protocol and replaces this one through ``ROUTERS``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import blake3


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerLoad:
    url: str
    in_flight: int  # requests this gateway has outstanding on the worker


@dataclass(frozen=True, kw_only=True, slots=True)
class RouteRequest:
    affinity_key: bytes | None  # None: no affinity (prompt shorter than a block and no cache key)
    candidates: Sequence[WorkerLoad]  # healthy workers serving the model, never empty


class Router(Protocol):
    def choose(self, request: RouteRequest) -> str:
        """The url of the worker to send the request to."""
        ...


def _score(affinity_key: bytes, url: str) -> bytes:
    return blake3.blake3(affinity_key + b"\0" + url.encode()).digest(8)


@dataclass(frozen=True, kw_only=True, slots=True)
class RendezvousRouter:
    """Highest-random-weight hashing with a load bound.

    Each worker's score is ``hash(affinity_key, url)``; the best-scoring worker wins unless it has more
    than ``max_load_factor`` × the mean in-flight load (+ ``load_slack``), in which case the next one in
    score order takes it (consistent hashing with bounded loads). Adding or removing a worker only moves
    the keys that scored best on it.
    """

    max_load_factor: float = 1.5
    load_slack: int = 4

    def choose(self, request: RouteRequest) -> str:
        candidates = list(request.candidates)
        if request.affinity_key is None:
            return min(candidates, key=lambda worker: (worker.in_flight, worker.url)).url
        ranked = sorted(candidates, key=lambda worker: _score(request.affinity_key, worker.url), reverse=True)
        mean = sum(worker.in_flight for worker in candidates) / len(candidates)
        bound = mean * self.max_load_factor + self.load_slack
        for worker in ranked:
            if worker.in_flight <= bound:
                return worker.url
        return ranked[0].url


@dataclass(frozen=True, kw_only=True, slots=True)
class LeastLoadedRouter:
    """No affinity: the worker with the fewest requests in flight (a baseline for benchmarks)."""

    def choose(self, request: RouteRequest) -> str:
        return min(request.candidates, key=lambda worker: (worker.in_flight, worker.url)).url


ROUTERS: Mapping[str, Callable[[], Router]] = {
    "rendezvous": RendezvousRouter,
    "least_loaded": LeastLoadedRouter,
}


def cache_key_affinity(namespace_key: bytes, prompt_cache_key: str) -> bytes:
    """Affinity key of a client's ``prompt_cache_key``, confined to its tenant's namespace."""
    return blake3.blake3(b"prompt-cache-key\0" + namespace_key + prompt_cache_key.encode()).digest()
