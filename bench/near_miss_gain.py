"""What near miss gains on near-duplicate prompts: a router alone vs the router + near miss, side by side.

    python -m bench.near_miss_gain --quick --plot docs/img/near_miss_gain.png   # 150 requests a pass
    python -m bench.near_miss_gain --seeds 0 1 2 --repeats 2                    # 600
    python -m bench.near_miss_gain --family no_index --quick --seeds 0 1 --repeats 2 \\
        --plot docs/img/near_miss_gain_no_index.png

``bench.routing``'s 3 workers and in-process gateway (fresh tenants and purged caches per pass), its
workloads ``near_duplicate`` (templates with 2 per-request fields at drawn block positions, bursts of
4–8) and ``near_duplicate_early`` (the first field in block 1–3: the siblings the cold route
scatters, which only near miss can bring together); ``--workloads near_duplicate_late`` (both fields
in the template's last 2 blocks: siblings share a long prefix). Policies, in turn within each
(workload, seed, pass), the order rotated from pass to pass. ``--family kv_aware`` (default):
``kv_aware``, ``kv_aware+near_miss`` (the default near miss: the namespace's latest prompts by
tokens) and ``kv_aware+near_miss+faiss`` (FAISS too, bound 15 ms). ``--family no_index``: the
deployments without a live KV-event index, where the router is blind to where a similar prompt went:
``consistent_hash`` (rendezvous over the first 4 blocks) and ``least_loaded``, each alone and + near
miss (latest prompts by tokens). ``--family no_index_moves``: ``least_loaded`` alone, + near miss,
and + near miss ``@cost``: the move rule without its in-flight condition (a request may move only to
a worker with no more requests in flight than its exact route's; patched in this process, bench
only), to show what that condition costs in reuse.

Per policy, pooled over passes: prompt tokens reused (cached tokens the workers reported), the hit
ratio, near-miss tokens (reuse beyond the exact index's prediction on moved requests: without an index,
all the reuse of a moved request), moves, TTFT p50/p99 from the clients, and the time each request
spends in ``NearMissRouting.route`` (``added``, p50/p99). The noise: two passes of one policy on one
seed (``--repeats 2``). The workload check: per (workload, seed) the ideal reuse (each request reusing
the longest full-block prefix it shares with an earlier request of its tenant) and the mean prefix, in
blocks, a request shares with its burst's first request. Reuse is exact-token in every policy: near
miss only chooses the worker. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import bench.routing as routing_bench
from bench.gateway_overhead import percentile
from gateway.config import GatewayConfig
from gateway.near_miss import NearMissRouting
from migrations import upgrade_database

NO_INDEX_NEAR_MISS = {"kv_index": False, "near_miss": True}
FAMILIES: dict[str, dict[str, dict]] = {
    "kv_aware": {
        name: routing_bench.POLICIES[name]
        for name in ("kv_aware", "kv_aware+near_miss", "kv_aware+near_miss+faiss")
    },
    "no_index": {
        "consistent_hash": routing_bench.POLICIES["consistent_hash"],
        "consistent_hash+near_miss": {"router": "rendezvous", **NO_INDEX_NEAR_MISS},
        "least_loaded": routing_bench.POLICIES["least_loaded"],
        "least_loaded+near_miss": {"router": "least_loaded", **NO_INDEX_NEAR_MISS},
    },
    # The move rule's price: near miss may move a request only to a worker with no more requests in
    # flight than its exact route's, which under least-loaded is the least loaded; ``@cost`` drops that
    # condition in this process (bench only) and keeps the rest (more reuse, a lower KV-aware cost).
    "no_index_moves": {
        "least_loaded": routing_bench.POLICIES["least_loaded"],
        "least_loaded+near_miss": {"router": "least_loaded", **NO_INDEX_NEAR_MISS},
        "least_loaded+near_miss@cost": {"router": "least_loaded", **NO_INDEX_NEAR_MISS, "move_rule": "cost"},
    },
}
WORKLOADS = ("near_duplicate", "near_duplicate_early")
BLOCK = routing_bench.BLOCK


def shared_blocks(a: list[int], b: list[int]) -> int:
    """Full blocks of the longest common token prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n // BLOCK


def workload_check(requests: list) -> dict:
    """The ideal reuse and how much a request shares with its burst's first (what near miss can lend)."""
    ideal, sibling, num_siblings = 0, 0, 0
    seen: dict[int, list[list[int]]] = {}
    previous = None
    for request in requests:
        earlier = seen.setdefault(request.tenant, [])
        ideal += max((shared_blocks(request.prompt, e) for e in earlier), default=0) * BLOCK
        # A burst: consecutive requests of one tenant whose first block is the same template's.
        if (
            previous is not None
            and previous[0] == request.tenant
            and previous[1][:BLOCK] == request.prompt[:BLOCK]
        ):
            sibling += shared_blocks(request.prompt, previous[2])
            num_siblings += 1
            leader = previous[2]
        else:
            leader = request.prompt
        previous = (request.tenant, request.prompt, leader)
        earlier.append(request.prompt)
    prompt = sum(len(r.prompt) for r in requests)
    return {
        "ideal_reused_tokens": ideal,
        "ideal_hit_ratio": round(ideal / max(1, prompt), 4),
        "siblings": num_siblings,
        "sibling_shared_blocks_mean": round(sibling / max(1, num_siblings), 2),
    }


def worth_moving_by_cost(self, request, exact, other, reusable_blocks: int) -> bool:
    """``NearMissRouting._worth_moving`` without its in-flight condition (the ``@cost`` policies)."""
    if reusable_blocks <= exact.cached_blocks:
        return False
    with_reuse = replace(
        other, cached_weighted_blocks=max(other.cached_weighted_blocks, float(reusable_blocks))
    )
    return self._cost(request, with_reuse) < self._cost(request, exact)


def time_near_miss(samples: list[float]) -> None:
    """Append the milliseconds each request spends in ``NearMissRouting.route`` to ``samples``."""
    route = NearMissRouting.route

    async def timed_route(self, *args, **kwargs):
        began = time.perf_counter()
        try:
            return await route(self, *args, **kwargs)
        finally:
            samples.append((time.perf_counter() - began) * 1000)

    NearMissRouting.route = timed_route  # type: ignore[method-assign]


async def run_passes(args, policies: dict[str, dict]) -> tuple[dict, dict]:
    """rows[workload][policy] = one dict per pass (``bench.routing.run_policy``'s, plus raw TTFTs and the
    near-miss times); checks[workload][seed] = ``workload_check``."""
    routing_bench.embedding_cost = lambda embedder, heads: {}  # bench.embedding measures the model alone
    added: list[float] = []
    time_near_miss(added)
    worth_moving = NearMissRouting._worth_moving
    num = 150 if args.quick else args.requests
    names = tuple(policies)
    rows = {kind: {name: [] for name in names} for kind in args.workloads}
    checks: dict[str, dict[int, dict]] = {kind: {} for kind in args.workloads}
    with tempfile.TemporaryDirectory() as tmp_name, Progress() as progress:
        tmp = Path(tmp_name)
        await asyncio.to_thread(upgrade_database, GatewayConfig(data_dir=tmp).resolved_database_url)
        with routing_bench.workers(3, args.num_blocks, tmp) as urls:
            turn = 0
            for rep in range(args.repeats):
                for seed in args.seeds:
                    for kind in args.workloads:
                        requests = routing_bench.workload(
                            kind, num, seed, prompts_per_tenant=args.prompts_per_tenant
                        )
                        checks[kind][seed] = workload_check(requests)
                        k = turn % len(names)
                        order = names[k:] + names[:k]  # each goes first in turn
                        turn += 1
                        for name in order:
                            added.clear()
                            by_cost = policies[name].get("move_rule") == "cost"
                            NearMissRouting._worth_moving = worth_moving_by_cost if by_cost else worth_moving
                            row = await routing_bench.run_policy(
                                kind, name, urls, requests, args, tmp, progress, settings=policies[name]
                            )
                            row.pop("embedding", None)
                            row["seed"], row["pass"] = seed, rep
                            row["added_ms"] = [round(x, 3) for x in added]
                            rows[kind][name].append(row)
                            brief = {k: v for k, v in row.items() if not isinstance(v, list)}
                            progress.console.print(f"{kind} {name} s{seed}r{rep}: {json.dumps(brief)}")
    return rows, checks


def pooled(passes: list[dict]) -> dict:
    prompt = sum(row["prompt_tokens"] for row in passes)
    cached = sum(row["cached_tokens"] for row in passes)
    ttfts = [x for row in passes for x in row["ttfts_ms"]]
    added = [x for row in passes for x in row["added_ms"]]
    moves = sum(row.get("near_miss_routes", {}).get("moved", 0) for row in passes)
    return {
        "passes": len(passes),
        "prompt_tokens": prompt,
        "reused_tokens": cached,
        "hit_ratio": round(cached / max(1, prompt), 4),
        "hit_ratio_per_pass": [row["hit_ratio"] for row in passes],
        "reused_tokens_per_pass": [row["cached_tokens"] for row in passes],
        "near_miss_tokens": sum(row["near_miss_tokens"] for row in passes),
        "moved": moves,
        "ttft_p50_ms": round(percentile(ttfts, 50), 1),
        "ttft_p99_ms": round(percentile(ttfts, 99), 1),
        "ttft_p50_ms_per_pass": [row["ttft_p50_ms"] for row in passes],
        "added_p50_ms": round(percentile(added, 50), 3) if added else None,
        "added_p99_ms": round(percentile(added, 99), 3) if added else None,
    }


def noise(passes: list[dict]) -> int:
    """The largest difference in reused tokens between two passes of one policy on one seed."""
    by_seed: dict[int, list[int]] = {}
    for row in passes:
        by_seed.setdefault(row["seed"], []).append(row["cached_tokens"])
    return max((max(v) - min(v) for v in by_seed.values() if len(v) > 1), default=0)


def plot(summary: dict, names: tuple[str, ...], path: Path) -> None:
    workloads = tuple(summary)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [k + (i - (len(names) - 1) / 2) * width for k in range(len(workloads))]
        axes[0].bar(xs, [summary[kind][name]["reused_tokens"] for kind in workloads], width, label=name)
        axes[1].bar(xs, [summary[kind][name]["near_miss_tokens"] for kind in workloads], width, label=name)
        axes[2].bar(xs, [summary[kind][name]["ttft_p50_ms"] for kind in workloads], width, label=name)
    titles = ("prompt tokens reused (pooled)", "near-miss tokens (pooled)", "TTFT p50 ms (pooled)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--family", choices=tuple(FAMILIES), default="kv_aware")
    parser.add_argument(
        "--workloads", nargs="+", choices=(*WORKLOADS, "near_duplicate_late"), default=WORKLOADS
    )
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--prompts-per-tenant", type=int, default=10)
    parser.add_argument("--slo-ms", type=float, default=250.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--plot", type=Path, default=Path("docs/img/near_miss_gain.png"))
    args = parser.parse_args()
    args.keep_ttfts = True
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    policies = FAMILIES[args.family]
    names = tuple(policies)
    rows, checks = asyncio.run(run_passes(args, policies))
    summary = {kind: {name: pooled(passes) for name, passes in by.items()} for kind, by in rows.items()}
    for kind, by in rows.items():
        for name, passes in by.items():
            summary[kind][name]["noise_reused_tokens"] = noise(passes)
    console = Console(width=200)
    for kind, by in summary.items():
        ideal = sum(c["ideal_reused_tokens"] for c in checks[kind].values())
        passes = by[names[0]]["passes"]
        table = Table(
            title=f"{kind}: pooled over {passes} passes per policy; ideal, one pass a seed: {ideal}"
        )
        for column in ("policy", "reused tokens", "hit ratio", "reused per pass", "noise", "near-miss tok"):
            table.add_column(column, justify="right")
        for column in ("moved", "TTFT p50", "TTFT p99", "p50 per pass", "added p50/p99 ms"):
            table.add_column(column, justify="right")
        for name, s in by.items():
            table.add_row(
                name,
                f"{s['reused_tokens']} / {s['prompt_tokens']}",
                f"{s['hit_ratio']:.4f}",
                " ".join(str(x) for x in s["reused_tokens_per_pass"]),
                str(s["noise_reused_tokens"]),
                str(s["near_miss_tokens"]),
                str(s["moved"]),
                f"{s['ttft_p50_ms']:.0f}",
                f"{s['ttft_p99_ms']:.0f}",
                " ".join(f"{x:.0f}" for x in s["ttft_p50_ms_per_pass"]),
                f"{s['added_p50_ms']} / {s['added_p99_ms']}" if s["added_p50_ms"] is not None else "-",
            )
        console.print(table)
        console.print(f"{kind} workload check per seed: {json.dumps(checks[kind])}")
    plot(summary, names, args.plot)
    console.print(f"plot: {args.plot}")
    print(json.dumps({"family": args.family, "summary": summary, "workload_check": checks}))


if __name__ == "__main__":
    main()
