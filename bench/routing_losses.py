"""Where KV-aware routing loses hits against the ideal (instrumentation for issue 12).

    python -m bench.routing_losses --quick --seeds 0 1 --policies round_robin least_loaded kv_aware
    python -m bench.routing_losses --simulate --seeds 0 1 2 3   # the LRU capacity bound, no servers
    python -m bench.routing_losses --opening --seeds $(seq 0 19)  # the opening burst's placement, no servers
    python -m bench.routing_losses --quick --seeds 0 1 --policies least_loaded kv_aware kv_aware@event

Runs ``bench.routing``'s ``multi_tenant`` workload on 3 real workers, policy after policy, and for the
KV-aware policy records every routing decision (what the KV-event index said each worker holds, the
worker chosen) beside what the worker then served from cache. Each request's *ideal* is the longest
block-aligned prefix it shares with an earlier request of its tenant (unlimited device memory); the
blocks it missed against that are charged to one cause:

- ``spill``: the index showed a holder, the router sent the request elsewhere (load bound);
- ``stale``: the request went to the holder, but the worker served fewer blocks than the index showed
  (evicted between the event and the prefill);
- ``evicted_part``: the index (rightly) showed fewer blocks than the ideal on the chosen worker and none
  elsewhere showed more: the prefix's tail was evicted;
- ``evicted_whole``: no worker held any of it per the index, and the request went where the last
  request of its prefix went, after that request's first token: the prefix was evicted there entirely
  (capacity);
- ``overlap``: the same, but the last request of its prefix had not had its first token yet when this
  one was sent (both prefilled it: concurrency, not capacity);
- ``cold_elsewhere``: no worker held any of it, and the request went to another worker than the last.

``kv_aware@event`` is KV-aware with followers woken by the KV event of their leader's head block only,
as before 2026-12-01 (now the gateway also wakes them at the leader's first token).

``--simulate`` replays the same requests through three leaf-first LRU caches of ``--num-blocks``
(minus the one the scheduler keeps free), one request at a time, with the rendezvous hash and with the
KV-aware rule (longest holder; a cold prefix to the less write-pressed of its two rendezvous workers,
remembered): the hit ratio capacity allows, with no index lag, no concurrency and no eviction policy
but LRU.

``--opening`` places the first ``--concurrency`` requests (the closed loop sends them at once, every cache
empty) with the KV-aware router and with least-loaded, as this gateway sees them (in flight and pending
prefill tokens counted per placement; a request whose head was placed before follows it and adds only
what it does not share with that worker's earlier prompt), and compares the most prefill tokens any one
worker got: the slowest of the opening's prefills waits for about that many. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import tempfile
import time
from collections import Counter, OrderedDict
from pathlib import Path

import aiohttp
from rich.progress import Progress

import gateway.pipeline as pipeline_module
import gateway.routing as routing
from bench.gateway_overhead import percentile
from bench.routing import ADMIN, BLOCK, POLICIES, one, start_gateway, workers, workload
from gateway.config import GatewayConfig
from migrations import upgrade_database

DECISIONS: dict[tuple[int, ...], dict] = {}
SENT: dict[int, tuple[float, float]] = {}  # request order -> (sent, first token), perf_counter
_CURRENT: dict[str, tuple[int, ...]] = {}


def instrument() -> None:
    """Record each KV-aware decision keyed by the prompt's token ids."""
    original = pipeline_module.RequestPipeline.route_request

    def route_request(self, model, token_ids, segments, prompt_cache_key):
        _CURRENT["prompt"] = tuple(token_ids)
        return original(self, model, token_ids, segments, prompt_cache_key)

    pipeline_module.RequestPipeline.route_request = route_request
    base = routing.ROUTERS["kv_aware"]

    class Recording(base):  # type: ignore[misc, valid-type]
        __slots__ = ()

        def choose_and_hold(self, request):
            url, hold_s = base.choose_and_hold(self, request)
            DECISIONS[_CURRENT.get("prompt", ())] = {
                "cached": {w.url: w.cached_blocks for w in request.candidates},
                "in_flight": {w.url: w.in_flight for w in request.candidates},
                "url": url,
                "hold_s": hold_s,
            }
            return url, hold_s

    def event_wake() -> routing.KVAwareRouter:  # followers woken by the KV event only (before 2026-12-01)
        return Recording(release_at_first_token=False)

    routing.ROUTERS = {**routing.ROUTERS, "kv_aware": Recording, "kv_aware@event": event_wake}  # type: ignore
    import gateway.app as app_module

    app_module.ROUTERS = routing.ROUTERS


# A variant to compare against: KV-aware whose followers wait for the KV event, not the leader's first token
VARIANTS = {"kv_aware@event": {"router": "kv_aware@event", "kv_index": True}}


async def run(name: str, urls: list[str], requests, args, tmp: Path, progress, tag: str) -> dict:
    settings = POLICIES.get(name) or VARIANTS[name]
    runner, base = await start_gateway(urls, tmp, settings)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN}"}) as admin:
        tenants = []
        for t in range(max(r.tenant for r in requests) + 1):
            body = {"name": f"{tag}-{name}-{t}", "near_miss_routing": False}
            async with admin.post(f"{base}/admin/v1/tenants", json=body) as r:
                tenants.append(await r.json())
        await asyncio.sleep(0.6)
    DECISIONS.clear()
    SENT.clear()
    served: list[tuple[int, tuple[int, ...], float, int]] = []  # (order, prompt, ttft, cached tokens)
    queue = list(enumerate(requests))
    task = progress.add_task(f"{tag} {name}", total=len(requests))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client() -> None:
            while queue:
                order, request = queue.pop(0)
                sent = time.perf_counter()
                ttft, usage = await one(session, base, tenants[request.tenant]["api_key"], request.prompt)
                cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
                served.append((order, tuple(request.prompt), ttft * 1000, cached))
                SENT[order] = (sent, sent + ttft)
                progress.advance(task)

        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        for tenant in tenants:
            for url in urls:
                async with session.post(f"{url}/v1/purge", json={"namespace_id": tenant["namespace_id"]}):
                    pass
    await runner.cleanup()
    return summarize(requests, served, dict(DECISIONS), warmup=2 * args.concurrency)


def common_blocks(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while (n + 1) * BLOCK <= min(len(a), len(b)) and a[: (n + 1) * BLOCK] == b[: (n + 1) * BLOCK]:
        n += 1
    return n


def summarize(requests, served, decisions: dict, warmup: int = 16) -> dict:
    by_order = {order: (prompt, ttft, cached) for order, prompt, ttft, cached in served}
    total_tokens = sum(len(r.prompt) for r in requests)
    ideal_tokens, lost = 0, Counter()
    last_url: dict[tuple[int, int], str] = {}  # (tenant, first block) -> worker of its last request
    last_order: dict[tuple[int, int], int] = {}  # (tenant, first block) -> order of its last request
    seen: dict[int, list[tuple[int, ...]]] = {}
    for order, request in enumerate(requests):
        prompt, _, cached = by_order[order]
        earlier = seen.setdefault(request.tenant, [])
        ideal = max((common_blocks(prompt, p) for p in earlier), default=0)
        ideal = min(ideal, (len(prompt) - 1) // BLOCK)  # the worker always computes the last token
        earlier.append(prompt)
        ideal_tokens += ideal * BLOCK
        got = cached // BLOCK
        miss = max(0, ideal - got)
        decision = decisions.get(prompt)
        head = (request.tenant, hash(prompt[:BLOCK]))
        if decision is not None:
            shown = max(decision["cached"].values())
            on_chosen = decision["cached"][decision["url"]]
            if miss:
                if shown == 0:
                    same = last_url.get(head) == decision["url"]
                    leader = SENT.get(last_order.get(head, -1))
                    overlap = leader is not None and SENT[order][0] < leader[1]
                    cause = ("overlap" if overlap else "evicted_whole") if same else "cold_elsewhere"
                elif on_chosen < shown:
                    cause = "spill"
                elif got < on_chosen:
                    cause = "stale"
                else:
                    cause = "evicted_part"
                lost[cause] += miss
            last_url[head] = decision["url"]
            last_order[head] = order
        elif miss:
            lost["unrecorded"] += miss
    ttfts = [t for _, t, _ in by_order.values()]
    tail_at = percentile(ttfts, 95)
    tail = [decisions.get(prompt) for prompt, ttft, _ in by_order.values() if ttft >= tail_at]
    tail = [d for d in tail if d is not None]
    if tail:  # what the slowest 5 % had in common when they were routed
        tail_info = {
            "n": len(tail),
            "cold": sum(max(d["cached"].values()) == 0 for d in tail),
            "held": sum(d.get("hold_s", 0) > 0 for d in tail),
            "chosen_in_flight": round(sum(d["in_flight"][d["url"]] for d in tail) / len(tail), 2),
            "min_in_flight": round(sum(min(d["in_flight"].values()) for d in tail) / len(tail), 2),
        }
    else:
        tail_info = {}
    cached_tokens = sum(c for _, _, c in by_order.values())
    # p99 of 150 is the second slowest request: which were they, and were they in the opening burst
    # (the first 2 x concurrency requests, sent while every cache was empty, for every policy alike)?
    slowest = sorted(by_order.items(), key=lambda item: -item[1][1])[:2]
    tail_requests = [
        {
            "order": order,
            "prompt_tokens": len(prompt),
            "cached_tokens": cached,
            "ttft_ms": round(ttft),
            "opening": order < warmup,
        }
        for order, (prompt, ttft, cached) in slowest
    ]
    after_warmup = [ttft for order, (_, ttft, _) in by_order.items() if order >= warmup]
    return {
        "hit_ratio": round(cached_tokens / total_tokens, 4),
        "ideal_hit_ratio": round(ideal_tokens / total_tokens, 4),
        "ttft_p50_ms": round(percentile(ttfts, 50), 1),
        "ttft_p99_ms": round(percentile(ttfts, 99), 1),
        "lost_blocks": dict(lost),
        "held": sum(1 for d in decisions.values() if d.get("hold_s", 0) > 0),  # followers that waited
        "slowest_5pct": tail_info,
        "slowest_2": tail_requests,
        "ttft_p99_after_opening_ms": round(percentile(after_warmup, 99), 1),
        "lost_hit_ratio": round(sum(lost.values()) * BLOCK / total_tokens, 4),
        "ttfts_ms": [round(by_order[order][1], 1) for order in sorted(by_order)],  # to pool passes
    }


def opening(seed: int, args, policy: str) -> int:
    """The most prefill tokens one worker gets from the opening burst (module docstring)."""
    requests = workload("multi_tenant", 150, seed, prompts_per_tenant=args.prompts_per_tenant)
    urls = [f"http://127.0.0.1:{port}" for port in (1, 2, 3)]
    router = routing.ROUTERS[policy]()
    pending, in_flight = dict.fromkeys(urls, 0), dict.fromkeys(urls, 0)
    placed: dict[str, list[tuple[int, ...]]] = {url: [] for url in urls}
    for request in requests[: args.concurrency]:
        prompt = tuple(request.prompt)
        candidates = [
            routing.WorkerLoad(url=url, in_flight=in_flight[url], pending_prefill_tokens=pending[url])
            for url in urls
        ]
        url = router.choose(
            routing.RouteRequest(
                affinity_key=repr((request.tenant, prompt[: 4 * BLOCK])).encode(),
                candidates=candidates,
                num_prompt_tokens=len(prompt),
                block_size=BLOCK,
            )
        )
        shared = max((common_blocks(prompt, other) for other in placed[url]), default=0)
        pending[url] += len(prompt) - shared * BLOCK
        in_flight[url] += 1
        placed[url].append(prompt)
    return max(pending.values())


def simulate(seed: int, args, placement: str, capacity: int | None) -> float:
    """Hit ratio of the workload on three leaf-first LRU caches (see the module docstring)."""
    requests = workload(
        "multi_tenant", 150 if args.quick else args.requests, seed, prompts_per_tenant=args.prompts_per_tenant
    )
    caches: list[OrderedDict] = [OrderedDict() for _ in range(3)]
    pressure, placed = [0.0] * 3, {}
    cached = total = 0
    for request in requests:
        prompt = request.prompt
        chain = [
            hash((request.tenant, tuple(prompt[: (k + 1) * BLOCK]))) for k in range(len(prompt) // BLOCK)
        ]
        key = repr(chain[:4]).encode()
        order = sorted(range(3), key=lambda w: routing._score(key, str(w)), reverse=True)
        held = [next((k for k, h in enumerate(chain) if h not in cache), len(chain)) for cache in caches]
        if placement == "hash":
            worker = order[0]
        elif max(held) > 0:
            worker = max(range(3), key=lambda w: (held[w], -order.index(w)))
        elif key in placed:
            worker = placed[key]
        else:
            least = min(pressure[w] for w in order[:2])
            worker = placed[key] = next(w for w in order[:2] if pressure[w] <= least + len(chain))
        cache = caches[worker]
        cached += min(held[worker], (len(prompt) - 1) // BLOCK) * BLOCK
        total += len(prompt)
        pressure = [p * 0.975 for p in pressure]  # decays like WRITE_PRESSURE_TAU_S over ~40 requests
        for block in reversed(chain):  # children first, so that the LRU order evicts leaves first
            pressure[worker] += block not in cache
            cache[block] = None
            cache.move_to_end(block)
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
    return round(cached / total, 4)


@contextlib.contextmanager
def worker_fleet(num_blocks: int, log_dir: Path, extra: list[str]):
    """``bench.routing.workers`` (3 of them), with extra worker flags for diagnosis (``--worker-args``)."""
    if not extra:
        with workers(3, num_blocks, log_dir) as urls:
            yield urls
        return
    original = subprocess.Popen

    def popen(cmd, *a, **kw):
        return original([*cmd, *extra], *a, **kw)

    subprocess.Popen = popen  # type: ignore[misc]
    try:
        with workers(3, num_blocks, log_dir) as urls:
            subprocess.Popen = original  # type: ignore[misc]
            yield urls
    finally:
        subprocess.Popen = original  # type: ignore[misc]


async def main_async(args) -> dict:
    instrument()
    num = 150 if args.quick else args.requests
    out: dict[str, dict] = {}
    with (
        tempfile.TemporaryDirectory() as tmp_name,
        worker_fleet(args.num_blocks, Path(tmp_name), args.worker_args.split()) as urls,
        Progress() as progress,
    ):
        database_url = GatewayConfig(data_dir=Path(tmp_name)).resolved_database_url
        await asyncio.to_thread(upgrade_database, database_url)
        for rep in range(args.repeats):
            for seed in args.seeds:
                requests = workload("multi_tenant", num, seed, prompts_per_tenant=args.prompts_per_tenant)
                for name in args.policies:
                    tag = f"s{seed}r{rep}"
                    started = time.time()
                    row = await run(name, urls, requests, args, Path(tmp_name), progress, tag)
                    row["wall_s"] = round(time.time() - started, 1)
                    out.setdefault(f"seed{seed}", {}).setdefault(name, []).append(row)
                    progress.console.print(f"{tag} {name}: {json.dumps(row)}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--prompts-per-tenant", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--worker-args", default="", help="extra worker flags, --worker-args='--a b'")
    parser.add_argument("--policies", nargs="+", default=["round_robin", "least_loaded", "kv_aware"])
    parser.add_argument("--simulate", action="store_true", help="the LRU capacity bound only")
    parser.add_argument("--opening", action="store_true", help="the opening burst's placement only")
    args = parser.parse_args()
    if args.opening:
        rows = {
            f"seed{seed}": {name: opening(seed, args, name) for name in ("kv_aware", "least_loaded")}
            for seed in args.seeds
        }
        ratios = [row["kv_aware"] / row["least_loaded"] for row in rows.values()]
        summary = {
            "kv_aware_vs_least_loaded_max_tokens": [round(r, 2) for r in ratios],
            "mean": round(sum(ratios) / len(ratios), 3),
            "kv_aware_worse": sum(r > 1 for r in ratios),
        }
        print(json.dumps({"opening_max_prefill_tokens": rows, "summary": summary}))
        return
    if args.simulate:
        rows = {
            f"seed{seed}": {
                "unlimited": simulate(seed, args, "hash", None),
                "lru_hash": simulate(seed, args, "hash", args.num_blocks - 1),
                "lru_kv_aware": simulate(seed, args, "kv_aware", args.num_blocks - 1),
            }
            for seed in args.seeds
        }
        print(json.dumps({"simulated": rows}))
        return
    out = asyncio.run(main_async(args))
    summary = {}
    for seed, by_policy in out.items():
        rr = by_policy.get("round_robin", [{}])
        for name, rows in by_policy.items():
            if "round_robin" in by_policy and name != "round_robin":
                summary[f"{seed}/{name}_vs_round_robin"] = [
                    round(r["hit_ratio"] / max(1e-9, b["hit_ratio"]), 3)
                    for r, b in zip(rows, rr, strict=False)
                ]
            if "least_loaded" in by_policy and name != "least_loaded":
                summary[f"{seed}/{name}_p99_vs_least_loaded"] = [
                    round(r["ttft_p99_ms"] / b["ttft_p99_ms"], 2)
                    for r, b in zip(rows, by_policy["least_loaded"], strict=False)
                ]
                summary[f"{seed}/{name}_p99_after_opening_vs_least_loaded"] = [
                    round(r["ttft_p99_after_opening_ms"] / b["ttft_p99_after_opening_ms"], 2)
                    for r, b in zip(rows, by_policy["least_loaded"], strict=False)
                ]
    print(json.dumps({"results": out, "summary": summary}))


if __name__ == "__main__":
    main()
