"""The opening burst's TTFTs, replayed in simulated time: no servers, no noise (issue 12, p99).

    python -m bench.routing_opening --seeds $(seq 0 19)
    python -m bench.routing_opening --seeds $(seq 0 19) --event-lag-ms 100 \
        --policies kv_aware@event kv_aware kv_aware@1 kv_aware@1.5 least_loaded

A quick ``bench.routing`` run has 150 requests, so its p99 is its second slowest; KV-aware's slowest
were mostly in the *opening burst* (the first 2 x concurrency requests, every cache empty), and there
mostly *followers*: requests whose head a leader had just placed on a worker, which wait for the
leader's prefill (``KVAwareRouter.choose_and_hold``) and then queue for their own suffix. This replays
the opening of ``bench.routing``'s ``multi_tenant`` workload through the real router objects
(``gateway.routing``) in simulated time, as the gateway and the worker see it:

- the gateway: ``concurrency`` closed-loop clients; per worker the requests in flight and the pending
  prefill tokens (uncached per the index when routed, added when sent, taken off at the first token);
  a follower's hold ends when the head block's KV event arrives (or the hold runs out); the index is
  the blocks whose events arrived, and write pressure the blocks stored;
- each worker: the scheduler's steps (``worker.scheduler``): decodes first, then prefill chunks FIFO
  within a ``--step-tokens`` budget; a step lasts (prefill tokens + ``--decode-cost-tokens`` per decode)
  / ``--prefill-tokens-per-s`` + ``--step-overhead-ms``; a sequence admitted reuses the blocks its worker
  published; a block is published at the end of the step that computed it and reaches the gateway's
  index ``--event-lag-ms`` later; ``max_tokens`` 4.

No eviction (the opening's blocks fit the 256-block pools) and no gateway overhead. Policies: a key of
``gateway.routing.ROUTERS``; ``kv_aware@event``, followers woken by the KV event only (as before
2026-12-01; the gateway now also wakes them at the leader's first token); ``kv_aware@F``, a follower
that would wait longer than F x a whole prefill elsewhere goes elsewhere (``DetourRouter``). Per seed:
every opening request's TTFT per policy; the summary compares the first policy's slowest, second
slowest (the quick run's p99 when they are in the opening) and mean against the last's, per policy.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import gateway.routing as routing
from bench.routing import BLOCK, workload

AFFINITY_BLOCKS = 4
MAX_TOKENS = 4


@dataclass(slots=True)
class Seq:
    order: int
    tenant: int
    prompt: tuple[int, ...]
    sent_s: float  # when its client sent it (TTFT counts from here, holds included)
    url: str = ""
    prefill_tokens: int = 0  # the gateway's pending count for it (uncached per the index when routed)
    computed: int = 0  # tokens computed (or reused) on the worker
    admitted: bool = False
    reused_tokens: int = 0  # what the worker found cached at admission
    generated: int = 0
    ttft_s: float | None = None
    held_s: float = 0.0
    route: routing.RouteRequest | None = None


@dataclass(slots=True)
class Worker:
    url: str
    published: set = field(default_factory=set)  # block keys: (tenant, tokens up to the block's end)
    indexed: set = field(default_factory=set)  # the same, once its KV event reached the gateway
    waiting: list[Seq] = field(default_factory=list)
    running: list[Seq] = field(default_factory=list)
    busy: bool = False
    stored_blocks: int = 0


class Replay:
    def __init__(self, requests, router, args) -> None:
        self.requests, self.router, self.args = requests, router, args
        self.now = 0.0
        self._events: list = []
        self._tie = itertools.count()
        self.workers = {f"http://w{i}": Worker(url=f"http://w{i}") for i in range(3)}
        self.in_flight = dict.fromkeys(self.workers, 0)
        self.pending = dict.fromkeys(self.workers, 0)
        self.holders: dict[tuple[str, tuple], list[Callable[[], None]]] = {}
        self.seqs: list[Seq] = []
        self._next = 0
        if hasattr(router, "clock"):
            router.clock = lambda: self.now

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._tie), action))

    def run(self, num_opening: int) -> list[Seq]:
        self.num_opening = num_opening
        for _ in range(self.args.concurrency):
            self.send_next()
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()
        return self.seqs

    # ---- the gateway ---------------------------------------------------------------------------
    def send_next(self) -> None:
        if self._next >= self.num_opening:
            return
        request = self.requests[self._next]
        seq = Seq(order=self._next, tenant=request.tenant, prompt=tuple(request.prompt), sent_s=self.now)
        self._next += 1
        self.seqs.append(seq)
        keys = [block_key(seq, k) for k in range(len(seq.prompt) // BLOCK)]
        cached = {url: cached_blocks(w.indexed, keys) for url, w in self.workers.items()}
        candidates = [
            routing.WorkerLoad(
                url=url,
                in_flight=self.in_flight[url],
                cached_blocks=cached[url],
                cached_weighted_blocks=float(cached[url]),
                write_pressure_blocks=float(w.stored_blocks),
                pending_prefill_tokens=self.pending[url],
            )
            for url, w in self.workers.items()
        ]
        head = keys[min(AFFINITY_BLOCKS, len(keys)) - 1] if keys else None
        route = routing.RouteRequest(
            affinity_key=repr(head).encode() if head else None,
            candidates=candidates,
            num_prompt_tokens=len(seq.prompt),
            block_size=BLOCK,
            head_block=repr(head).encode() if head else None,
            request_id=str(seq.order),
        )
        hold = getattr(self.router, "choose_and_hold", None)
        url, hold_s = hold(route) if hold else (self.router.choose(route), 0.0)
        seq.url, seq.route = url, route
        seq.prefill_tokens = max(1, len(seq.prompt) - cached[url] * BLOCK)
        if hold_s <= 0 or head in self.workers[url].indexed:
            self.dispatch(seq)
            return
        done = []

        def wake() -> None:
            if not done:
                done.append(True)
                seq.held_s = self.now - seq.sent_s
                self.dispatch(seq)

        self.holders.setdefault((url, head), []).append(wake)
        self.at(self.now + hold_s, wake)

    def dispatch(self, seq: Seq) -> None:
        self.in_flight[seq.url] += 1
        self.pending[seq.url] += seq.prefill_tokens
        worker = self.workers[seq.url]
        worker.waiting.append(seq)
        if not worker.busy:
            self.step(worker)

    # ---- a worker ------------------------------------------------------------------------------
    def step(self, worker: Worker) -> None:
        args = self.args
        decodes = [s for s in worker.running if s.computed >= len(s.prompt)]
        budget = args.step_tokens - len(decodes)
        chunks: list[tuple[Seq, int]] = []
        for seq in [s for s in worker.running if s.computed < len(s.prompt)] + list(worker.waiting):
            if budget <= 0:
                break
            if not seq.admitted:
                keys = [block_key(seq, k) for k in range((len(seq.prompt) - 1) // BLOCK)]
                seq.computed, seq.admitted = cached_blocks(worker.published, keys) * BLOCK, True
                seq.reused_tokens = seq.computed
                worker.waiting.remove(seq)
                worker.running.append(seq)
            length = min(budget, len(seq.prompt) - seq.computed)
            chunks.append((seq, length))
            budget -= length
        if not chunks and not decodes:
            worker.busy = False
            return
        worker.busy = True
        tokens = sum(n for _, n in chunks) + args.decode_cost_tokens * len(decodes)
        duration = tokens / args.prefill_tokens_per_s + args.step_overhead_ms / 1000

        def end() -> None:
            for seq, length in chunks:
                seq.computed += length
                for k in range(seq.computed // BLOCK):
                    self.publish(worker, block_key(seq, k))
                if seq.computed >= len(seq.prompt):
                    seq.ttft_s, seq.generated = self.now - seq.sent_s, 1
                    self.pending[seq.url] -= seq.prefill_tokens
                    self.first_token(seq)
            for seq in decodes:
                seq.generated += 1
                if seq.generated >= MAX_TOKENS:
                    worker.running.remove(seq)
                    self.in_flight[seq.url] -= 1
                    self.send_next()
            self.step(worker)

        self.at(self.now + duration, end)

    def first_token(self, seq: Seq) -> None:
        """The gateway has the first token: a leader's followers go (``KVAwareRouter.leader_prefilled``)."""
        prefilled = getattr(self.router, "leader_prefilled", None)
        if prefilled is None or seq.route is None or not prefilled(seq.route, seq.url):
            return
        head = block_key(seq, min(AFFINITY_BLOCKS, len(seq.prompt) // BLOCK) - 1)
        for wake in self.holders.pop((seq.url, head), []):
            wake()

    def publish(self, worker: Worker, key: tuple) -> None:
        if key in worker.published:
            return
        worker.published.add(key)

        def arrive() -> None:  # the KV event reaches the gateway's index
            worker.indexed.add(key)
            worker.stored_blocks += 1
            for wake in self.holders.pop((worker.url, key), []):
                wake()

        self.at(self.now + self.args.event_lag_ms / 1000, arrive)


@dataclass(kw_only=True, slots=True)
class DetourRouter(routing.KVAwareRouter):
    """KV-aware, but a follower that would wait longer behind its leader than a whole prefill takes
    elsewhere goes elsewhere (measured here, not adopted: docs/routing.md). Behind its leader it waits for
    that worker's backlog (the leader's prefill included) and then computes what it does not share with
    the leader's head; elsewhere it computes the whole prompt behind that worker's backlog. A detour
    leaves a second copy of the head, so it must win by ``detour_factor``."""

    detour_factor: float = 1.0

    def place_cold(self, request: routing.RouteRequest) -> tuple[str, float]:
        url, hold_s = routing.KVAwareRouter.place_cold(self, request)
        if hold_s <= 0:
            return url, hold_s
        leader = next(worker for worker in request.candidates if worker.url == url)
        head_tokens = AFFINITY_BLOCKS * request.block_size
        follow = self.backlog_tokens(leader) + max(0, request.num_prompt_tokens - head_tokens)
        others = [worker for worker in request.candidates if worker.url != url]
        best = min(others, key=self.backlog_tokens)
        alone = self.backlog_tokens(best) + request.num_prompt_tokens
        return (best.url, 0.0) if alone * self.detour_factor < follow else (url, hold_s)


def block_key(seq: Seq, k: int) -> tuple:
    return (seq.tenant, seq.prompt[: (k + 1) * BLOCK])


def cached_blocks(blocks: set, keys: list) -> int:
    return next((k for k, key in enumerate(keys) if key not in blocks), len(keys))


def replay(seed: int, policy: str, args) -> list[Seq]:
    requests = workload("multi_tenant", 150, seed, prompts_per_tenant=args.prompts_per_tenant)
    name, _, variant = policy.partition("@")
    if variant == "event":  # followers woken by the KV event only (before 2026-12-01)
        router = routing.KVAwareRouter(release_at_first_token=False)
    elif variant:  # kv_aware@1.5: followers detour when alone elsewhere x 1.5 < behind the leader
        router = DetourRouter(detour_factor=float(variant))
    else:
        router = routing.ROUTERS[name]()
    return Replay(requests, router, args).run(2 * args.concurrency)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(20)))
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompts-per-tenant", type=int, default=10)
    parser.add_argument("--prefill-tokens-per-s", type=float, default=4000.0)
    parser.add_argument("--decode-cost-tokens", type=float, default=8.0)
    parser.add_argument("--step-overhead-ms", type=float, default=2.0)
    parser.add_argument("--step-tokens", type=int, default=512)
    parser.add_argument("--event-lag-ms", type=float, default=5.0, help="block published -> gateway index")
    parser.add_argument("--policies", nargs="+", default=["kv_aware@event", "kv_aware", "least_loaded"])
    args = parser.parse_args()
    rows: dict[str, dict] = {}
    for seed in args.seeds:
        row = rows[f"seed{seed}"] = {}
        for policy in args.policies:
            seqs = replay(seed, policy, args)
            slow = sorted(seqs, key=lambda s: -s.ttft_s)
            ttfts = [s.ttft_s * 1000 for s in slow]
            row[policy] = {
                "slowest_ms": round(ttfts[0], 1),
                "second_ms": round(ttfts[1], 1),
                "mean_ms": round(sum(ttfts) / len(ttfts), 1),
                "held": sum(s.held_s > 0 for s in seqs),
                "slowest_2_held": sum(s.held_s > 0 for s in slow[:2]),
                "reused_tokens": sum(s.reused_tokens for s in seqs),
            }
        print(f"seed {seed}: {json.dumps(row)}")
    base = args.policies[-1]
    summary: dict[str, dict] = {}
    for policy in args.policies[:-1]:
        held = [row[policy]["slowest_2_held"] for row in rows.values()]
        summary[policy] = {
            "slowest_2_held": sum(held),
            "reused_tokens": sum(r[policy]["reused_tokens"] for r in rows.values()),
        }
        for stat in ("slowest_ms", "second_ms", "mean_ms"):
            ratios = [row[policy][stat] / row[base][stat] for row in rows.values()]
            summary[policy][f"{stat}_vs_{base}"] = {
                "ratios": [round(r, 2) for r in ratios],
                "mean": round(sum(ratios) / len(ratios), 3),
                "above_1": sum(r > 1 for r in ratios),
            }
    print(json.dumps({"opening_ttft": rows, "summary": summary}))


if __name__ == "__main__":
    main()
