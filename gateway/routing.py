"""Worker routing: pure decision objects picked from a registry.

The request's affinity key is derived inside its namespace (a block hash of the first blocks of the
prompt, or the tenant's ``prompt_cache_key`` mixed with its namespace key), so two tenants never
collide on purpose and one tenant's prompts with the same head land on the same worker, where its
blocks are cached. ``KVAwareRouter`` (the default) uses what the workers' KV events say they hold
(``gateway.kv_index``): the longest cached prefix, weighted by tier, against each worker's load; it
falls back to the rendezvous hash when no worker holds any of the prompt.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import blake3


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerLoad:
    url: str
    in_flight: int  # requests this gateway has outstanding on the worker
    cached_blocks: int = 0  # leading blocks of the prompt the worker holds (KV-event index)
    cached_weighted_blocks: float = 0.0  # the same, weighted by tier (gateway.kv_index.TIER_WEIGHTS)
    num_running: int = 0  # sequences running on the worker (its last report, all gateways)
    queued_prefill_tokens: int = 0  # prompt tokens waiting for prefill there (its last report)


@dataclass(frozen=True, kw_only=True, slots=True)
class RouteRequest:
    affinity_key: bytes | None  # None: no affinity (prompt shorter than a block and no cache key)
    candidates: Sequence[WorkerLoad]  # healthy workers serving the model, never empty
    num_prompt_tokens: int = 0
    block_size: int = 16


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


@dataclass(frozen=True, kw_only=True, slots=True)
class KVAwareRouter:
    """Longest cached prefix against load, from the workers' KV events.

    The cost of sending a request to a worker, in prefill-token equivalents, is the part of the prompt
    it would have to compute (the prompt minus its cached prefix, blocks weighted by tier) plus the
    prompt tokens already queued there plus ``running_cost_tokens`` per running sequence (the larger of
    its own report and this gateway's in-flight count). The cheapest worker wins; ties go to the
    rendezvous order. When no worker holds ``min_cached_blocks`` of the prompt (a cold prefix) the
    rendezvous hash decides, so the first requests of a new prefix still gather on one worker.
    """

    running_cost_tokens: float = 8.0  # a decode step is cheap next to prefill (measured: bench.routing)
    min_cached_blocks: int = 1
    duplicate_cost_factor: float = 0.0
    fallback: RendezvousRouter = RendezvousRouter()

    def cost_tokens(self, request: RouteRequest, worker: WorkerLoad, best: float = 0.0) -> float:
        uncached = max(0.0, request.num_prompt_tokens - worker.cached_weighted_blocks * request.block_size)
        running = max(worker.num_running, worker.in_flight)
        duplicated = max(0.0, best - worker.cached_weighted_blocks) * request.block_size
        return (
            uncached
            + worker.queued_prefill_tokens
            + self.running_cost_tokens * running
            + self.duplicate_cost_factor * duplicated
        )

    def choose(self, request: RouteRequest) -> str:
        if max(worker.cached_blocks for worker in request.candidates) < self.min_cached_blocks:
            return self.fallback.choose(request)
        key = request.affinity_key or b""
        best = max(worker.cached_weighted_blocks for worker in request.candidates)
        return min(
            request.candidates,
            key=lambda w: (self.cost_tokens(request, w, best), _score(key, w.url)[::-1], w.url),
        ).url


@dataclass(slots=True)
class RoundRobinRouter:
    """Each worker in turn (a benchmark baseline)."""

    _turn: itertools.count = field(default_factory=itertools.count)

    def choose(self, request: RouteRequest) -> str:
        ordered = sorted(worker.url for worker in request.candidates)
        return ordered[next(self._turn) % len(ordered)]


@dataclass(slots=True)
class RandomRouter:
    """A uniformly random worker (a benchmark baseline)."""

    rng: random.Random = field(default_factory=random.Random)

    def choose(self, request: RouteRequest) -> str:
        return self.rng.choice(list(request.candidates)).url


ROUTERS: Mapping[str, Callable[[], Router]] = {
    "kv_aware": KVAwareRouter,
    "rendezvous": RendezvousRouter,
    "least_loaded": LeastLoadedRouter,
    "round_robin": RoundRobinRouter,
    "random": RandomRouter,
}


def cache_key_affinity(namespace_key: bytes, prompt_cache_key: str) -> bytes:
    """Affinity key of a client's ``prompt_cache_key``, confined to its tenant's namespace."""
    return blake3.blake3(b"prompt-cache-key\0" + namespace_key + prompt_cache_key.encode()).digest()
