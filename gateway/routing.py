"""Worker routing: pure decision objects picked from a registry.

The request's affinity key is derived inside its namespace (a block hash of the first blocks of the
prompt, or the tenant's ``prompt_cache_key`` mixed with its namespace key), so two tenants never
collide on purpose and one tenant's prompts with the same head land on the same worker, where its
blocks are cached. ``KVAwareRouter`` (the default) uses what the workers' KV events say they hold
(``gateway.kv_index``): a request stays with the worker holding its longest cached prefix unless that
worker is over the load bound, and a prefix no worker holds goes to the less write-pressed of its two
rendezvous workers (docs/routing.md explains the rule).
"""

from __future__ import annotations

import itertools
import random
import time
from collections import OrderedDict
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
    write_pressure_blocks: float = 0.0  # device-pool blocks it stored lately (gateway.kv_index, decayed)
    # Uncached prompt tokens of this gateway's requests there that have no first token yet (immediate,
    # unlike the worker's own report, which arrives with its KV events)
    pending_prefill_tokens: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class RouteRequest:
    affinity_key: bytes | None  # None: no affinity (prompt shorter than a block and no cache key)
    candidates: Sequence[WorkerLoad]  # healthy workers serving the model, never empty
    num_prompt_tokens: int = 0
    block_size: int = 16
    head_block: bytes | None = None  # hash of the last block of the affinity head (KV-event index on)
    request_id: str = ""  # whose request: only its own failure drops a placement it made (drop_placement)


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

    def load_bound(self, candidates: Sequence[WorkerLoad]) -> float:
        """The most requests in flight a worker may have and still take more for its keys."""
        mean = sum(worker.in_flight for worker in candidates) / len(candidates)
        return mean * self.max_load_factor + self.load_slack

    def choose(self, request: RouteRequest) -> str:
        candidates = list(request.candidates)
        if request.affinity_key is None:
            return min(candidates, key=lambda worker: (worker.in_flight, worker.url)).url
        ranked = sorted(candidates, key=lambda worker: _score(request.affinity_key, worker.url), reverse=True)
        bound = self.load_bound(candidates)
        for worker in ranked:
            if worker.in_flight <= bound:
                return worker.url
        return ranked[0].url


@dataclass(frozen=True, kw_only=True, slots=True)
class LeastLoadedRouter:
    """No affinity: the worker with the fewest requests in flight (a baseline for benchmarks)."""

    def choose(self, request: RouteRequest) -> str:
        return min(request.candidates, key=lambda worker: (worker.in_flight, worker.url)).url


@dataclass(kw_only=True, slots=True)
class KVAwareRouter:
    """Cached prefixes stay where they are; new ones go where caches last. From the workers' KV events.

    The scarce resource is cache capacity: a second copy of a prefix on another worker costs its prefill
    once and then, caches being full, displaces as many blocks of other prefixes, which miss later.
    So load moves a request off the worker holding its longest prefix only as consistent hashing with
    bounded loads would: when that worker has more than the rendezvous load bound in flight
    (``RendezvousRouter.load_bound``). Then, and between equal holders, the cheapest worker wins: the
    cost, in prefill-token equivalents, is the part of the prompt it would have to compute (the prompt
    minus its cached prefix, blocks weighted by tier) plus the prompt tokens already queued there plus
    ``running_cost_tokens`` per running sequence (the larger of its own report and this gateway's
    in-flight count); ties go to the rendezvous order.

    A cold prefix (no worker holds ``min_cached_blocks`` of it: new, or evicted everywhere) will be hit
    only as long as the cache it lands in keeps it, so of its two best rendezvous workers (within the
    load bound) it goes to the one under less *write pressure* (device-pool blocks stored lately, from
    the KV events): the cache that turns over slower. But its whole prompt is to be prefilled, so if
    one of the two has a backlog (``backlog_tokens``: prefill tokens waiting there, this gateway's
    pending count being exact at once, plus running sequences) larger than the other's by more than
    the prompt itself, the less busy one takes it (the power of two choices; the slowest 5 % of
    KV-aware requests in ``bench.routing_losses`` were such prefills on the busier worker). Two
    choices, not all workers: every gateway replica sees the same stale pressures for a moment, and
    two choices per key do not herd new prefixes onto one worker while the index lags. Pressures less
    than one prompt's blocks apart count as equal; between equals the smaller backlog wins (in the
    opening burst, every cache empty, this deals the cold prompts out like least-loaded does, by
    tokens), and the rendezvous order only breaks exact ties. A placement is remembered
    (``remembered_placements`` keys, per router): until the prefix's blocks reach the index, its next
    requests follow the first to the same worker even if pressures moved meanwhile, as the plain hash
    would send them.
    """

    running_cost_tokens: float = 8.0  # a decode step is cheap next to prefill (measured: bench.routing)
    min_cached_blocks: int = 1
    fallback: RendezvousRouter = RendezvousRouter()
    remembered_placements: int = 4096
    leader_hold_s: float = 2.0  # the longest a follower waits for its leader's prefill (see choose_and_hold)
    # leader_prefilled: a leader's first token ends its followers' hold (False: only the KV event does, as
    # before 2026-12-01; bench.routing_losses and bench.routing_opening compare the two)
    release_at_first_token: bool = True
    clock: Callable[[], float] = time.monotonic
    # key -> (url, placed at, head block, request id): a follower holds only for the same head (a
    # prompt_cache_key groups different prompts under one key; one of them waited the full hold for a head
    # nobody computed), and only while the leader may still compute it (drop_placement)
    _placed: OrderedDict[bytes, tuple[str, float, bytes | None, str]] = field(default_factory=OrderedDict)

    def cost_tokens(self, request: RouteRequest, worker: WorkerLoad) -> float:
        uncached = max(0.0, request.num_prompt_tokens - worker.cached_weighted_blocks * request.block_size)
        return uncached + self.backlog_tokens(worker)

    def backlog_tokens(self, worker: WorkerLoad) -> float:
        """The work ahead of a new request there, in prefill tokens: prompt tokens waiting to be
        prefilled (the worker's report, or this gateway's own count when larger: the report lags by
        up to one KV-event poll) plus ``running_cost_tokens`` per running sequence."""
        queued = max(worker.queued_prefill_tokens, worker.pending_prefill_tokens)
        return queued + self.running_cost_tokens * max(worker.num_running, worker.in_flight)

    def choose(self, request: RouteRequest) -> str:
        return self.choose_and_hold(request)[0]

    def choose_and_hold(self, request: RouteRequest) -> tuple[str, float]:
        """The worker, and how long the request should wait before it is sent (seconds, 0: none).

        A *follower*, a request whose cold prefix this router placed less than ``leader_hold_s`` ago
        on the worker it goes to now, most likely arrives while its *leader* (the request placed
        first) is still being prefilled there: sent at once, it would compute the same prefix a second
        time beside it. It waits instead until the worker announces the prefix's head block (the
        caller waits on the KV-event index, ``PrefixIndex.wait_stored``), at most until the leader
        has been placed ``leader_hold_s``; then it finds the prefix cached."""
        candidates = request.candidates
        if max(worker.cached_blocks for worker in candidates) < self.min_cached_blocks:
            return self.place_cold(request)
        key = request.affinity_key or b""
        bound = self.fallback.load_bound(candidates)
        best = max(worker.cached_weighted_blocks for worker in candidates)
        holders = [w for w in candidates if w.cached_weighted_blocks >= best and w.in_flight <= bound]
        best_url = min(
            holders or candidates, key=lambda w: (self.cost_tokens(request, w), _rank(key, w.url), w.url)
        ).url
        return best_url, 0.0

    def place_cold(self, request: RouteRequest) -> tuple[str, float]:
        """The worker for a prefix no worker holds, and the hold of a follower (class docstring)."""
        if request.affinity_key is None:
            return self.fallback.choose(request), 0.0
        key = request.affinity_key
        ranked = sorted(request.candidates, key=lambda worker: _rank(key, worker.url))
        bound = self.fallback.load_bound(ranked)
        eligible = [worker for worker in ranked if worker.in_flight <= bound] or ranked
        placed = self._placed.get(key)
        now = self.clock()
        if placed is not None and any(worker.url == placed[0] for worker in eligible):
            self._placed.move_to_end(key)
            same_head = request.head_block is not None and request.head_block == placed[2]
            hold = placed[1] + self.leader_hold_s - now if same_head else 0.0
            return placed[0], max(0.0, hold)
        choices = eligible[:2]  # in rendezvous order: min() keeps it between equals
        least = min(worker.write_pressure_blocks for worker in choices)
        tolerance = max(1.0, request.num_prompt_tokens / request.block_size)  # what this prompt writes
        calm = [w for w in choices if w.write_pressure_blocks <= least + tolerance]
        backlogs = [self.backlog_tokens(worker) for worker in choices]
        if len(choices) == 2 and abs(backlogs[0] - backlogs[1]) > request.num_prompt_tokens:
            # its whole prefill queues there: more than its own prefill's worth of waiting doubles its TTFT
            url = choices[backlogs[1] < backlogs[0]].url
        else:  # between equally pressed caches, the shorter prefill queue (the hash order only breaks ties)
            url = min(calm, key=self.backlog_tokens).url
        self._placed[key] = (url, now, request.head_block, request.request_id)
        if len(self._placed) > self.remembered_placements:
            self._placed.popitem(last=False)
        return url, 0.0

    def leader_of(self, request: RouteRequest) -> str:
        """The request id of the leader whose placement ``request`` follows ("" when none is remembered):
        a follower waits for that leader's prefill, and only its drop releases the follower."""
        placed = self._placed.get(request.affinity_key) if request.affinity_key is not None else None
        return "" if placed is None else placed[3]

    def leader_prefilled(self, request: RouteRequest, url: str) -> bool:
        """``request`` had its first token from ``url``: if it is the leader of the placement remembered
        for its key there, its prefix is cached on that worker now, so its followers need not wait any
        longer (True: release those waiting), and later ones do not wait at all. The KV event saying so
        comes later (the worker's long-poll, then the gateway's index: a few ms on one gateway here,
        more when the event stream lags), and a follower woken by it waited that much longer."""
        if not self.release_at_first_token:
            return False
        key = request.affinity_key
        placed = self._placed.get(key) if key is not None and request.request_id else None
        if placed is None or placed[3] != request.request_id or placed[0] != url:
            return False
        self._placed[key] = (placed[0], float("-inf"), placed[2], placed[3])  # no follower holds any more
        return True

    def drop_placement(self, request: RouteRequest) -> str | None:
        """Forget the cold placement ``request`` made, if it is still the one remembered (its request id):
        the request was refused, failed, cancelled or sent elsewhere, so its prefix may never be computed
        there and no follower may wait for it. A follower's failure leaves its leader's placement.
        Returns the url of the placement dropped (None: none)."""
        key = request.affinity_key
        placed = self._placed.get(key) if key is not None and request.request_id else None
        if placed is None or placed[3] != request.request_id:
            return None
        del self._placed[key]
        return placed[0]


def _rank(affinity_key: bytes, url: str) -> bytes:
    """Sort key giving the rendezvous order (best score first)."""
    return bytes(255 - b for b in _score(affinity_key, url))


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
