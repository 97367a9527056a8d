"""What near miss with FAISS adds to a request's path (and, at commit a54b3c1, early vs late embedding).

    python -m bench.near_miss_path --quick                 # 150 requests per pass, 2 passes per mode
    python -m bench.near_miss_path --repeats 3 --seeds 0 1

``bench.routing``'s 3 workers and in-process gateway, the ``kv_aware+near_miss+faiss`` policy
(``near_miss_max_wait_ms`` 15) on its ``near_duplicate`` workload. At commit a54b3c1 (reverted: it did
not pay, docs/BENCHMARKS.md) the gateway could start the head's urgent embedding right after the prompt
was tokenized (``NearMissRouting.start_embedding``); there this runs two modes alternating pass by
pass, ``early`` and ``late`` (``near_miss_early_embedding`` off: ``route`` starts it when it finds it
needs one, as now). Elsewhere one mode, ``as_is``.

Measured in the gateway's process, per request of the near-miss tenants (every request here):
- ``added``: the time the request spends in near miss on its path: ``NearMissRouting.route`` (nominate,
  verify on tokens, and wait for the embedding when it searches FAISS; plus ``start_embedding`` where it
  exists). Requests that need no search count with their small cost;
- ``wait``: of the requests that waited for an embedding (``route`` searched FAISS and the vector was not
  at hand), the time waited, bounded by 15 ms (``late``: not ready within it);
- ``head start`` (``early`` only): from the early embedding's submission to ``route``, the routing time
  it overlaps (the most it can save);
- TTFT p50/p99 from the clients, hit ratio and this process's CPU per request, as in ``bench.routing``.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import bench.routing as routing_bench
from bench.gateway_overhead import percentile
from gateway.config import GatewayConfig
from gateway.near_miss import NearMissRouting
from migrations import upgrade_database

MODES = {"as_is": {"near_miss_max_wait_ms": 15.0}}
if "near_miss_early_embedding" in GatewayConfig.__dataclass_fields__:  # commit a54b3c1 (reverted) only
    MODES = {
        "early": {"near_miss_max_wait_ms": 15.0, "near_miss_early_embedding": True},
        "late": {"near_miss_max_wait_ms": 15.0, "near_miss_early_embedding": False},
    }
SAMPLES: dict[str, list[float]] = {"added": [], "wait": [], "late": [], "head_start": []}


def instrument() -> None:
    """Time ``start_embedding``, ``route`` and the embedding wait inside it (milliseconds)."""
    start = getattr(NearMissRouting, "start_embedding", None)  # commit a54b3c1 (reverted) only
    route, wait = NearMissRouting.route, NearMissRouting._embed_within_bound
    started_ms: dict[int, float] = {}  # id(token_ids) -> start_embedding's time, added to its route's
    started_at: dict[int, float] = {}  # id(token_ids) -> when its early embedding was submitted

    def start_embedding(self, tenant, model, token_ids, segments):
        began = time.perf_counter()
        early = start(self, tenant, model, token_ids, segments)
        started_ms[id(token_ids)] = (time.perf_counter() - began) * 1000
        if early is not None:
            started_at[id(token_ids)] = time.perf_counter()
        return early

    async def timed_route(self, tenant, model, token_ids, segments, request, exact_url, *early):
        began = time.perf_counter()
        submitted = started_at.pop(id(token_ids), None)
        if submitted is not None:  # the head start the early embedding got: routing time it overlaps
            SAMPLES["head_start"].append((began - submitted) * 1000)
        try:
            return await route(self, tenant, model, token_ids, segments, request, exact_url, *early)
        finally:
            spent = (time.perf_counter() - began) * 1000
            SAMPLES["added"].append(spent + started_ms.pop(id(token_ids), 0.0))

    async def timed_wait(self, head, tenant_id, *early):
        at_hand = self.embedder.cached(head, tenant=tenant_id) is not None
        began = time.perf_counter()
        vector = await wait(self, head, tenant_id, *early)
        if not at_hand:
            SAMPLES["wait"].append((time.perf_counter() - began) * 1000)
            SAMPLES["late"].append(float(vector is None))
        return vector

    if start is not None:
        NearMissRouting.start_embedding = start_embedding  # type: ignore[attr-defined]
    NearMissRouting.route = timed_route  # type: ignore[method-assign]
    NearMissRouting._embed_within_bound = timed_wait  # type: ignore[method-assign]


async def main_async(args) -> dict:
    instrument()
    routing_bench.embedding_cost = lambda embedder, heads: {}  # bench.embedding measures the model alone
    for mode, config in MODES.items():
        routing_bench.POLICIES[mode] = {
            "router": "kv_aware",
            "kv_index": True,
            "near_miss": True,
            "config": config,
        }
    num = 150 if args.quick else args.requests
    rows: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp_name, Progress() as progress:
        tmp = Path(tmp_name)
        database_url = GatewayConfig(data_dir=tmp).resolved_database_url
        await asyncio.to_thread(upgrade_database, database_url)
        with routing_bench.workers(3, args.num_blocks, tmp) as urls:
            for rep in range(args.repeats):
                for seed in args.seeds:
                    requests = routing_bench.workload(
                        "near_duplicate", num, seed, prompts_per_tenant=args.prompts_per_tenant
                    )
                    for mode in MODES if rep % 2 == 0 else reversed(MODES):  # alternate which goes first
                        for samples in SAMPLES.values():
                            samples.clear()
                        row = await routing_bench.run_policy(
                            "near_duplicate", mode, urls, requests, args, tmp, progress
                        )
                        row.pop("embedding", None)
                        row.update(summarize(SAMPLES))
                        row["seed"], row["pass"] = seed, rep
                        rows[mode].append(row)
                        progress.console.print(f"{mode} s{seed}r{rep}: {json.dumps(row)}")
    return rows


def summarize(samples: dict[str, list[float]]) -> dict:
    added, wait = samples["added"], samples["wait"]
    return {
        "near_miss_requests": len(added),
        "added_p50_ms": round(percentile(added, 50), 2) if added else None,
        "added_p99_ms": round(percentile(added, 99), 2) if added else None,
        "waited": len(wait),
        "wait_p50_ms": round(percentile(wait, 50), 2) if wait else None,
        "wait_p99_ms": round(percentile(wait, 99), 2) if wait else None,
        "late": int(sum(samples["late"])),
        "early_started": len(samples["head_start"]),
        "head_start_p50_ms": round(percentile(samples["head_start"], 50), 2)
        if samples["head_start"]
        else None,
        "added_ms": [round(x, 2) for x in added],  # to pool passes
        "wait_ms": [round(x, 2) for x in wait],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--prompts-per-tenant", type=int, default=10)
    parser.add_argument("--slo-ms", type=float, default=250.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rows = asyncio.run(main_async(args))
    table = Table(title="near miss + FAISS on the request path (pooled over passes), ms")
    for column in ("mode", "passes", "hit ratio", "TTFT p50", "TTFT p99", "added p50", "added p99"):
        table.add_column(column)
    for column in ("waited", "wait p50", "wait p99", "late", "CPU ms/req"):
        table.add_column(column)
    summary: dict[str, dict] = {}
    for mode, passes in rows.items():
        added = [x for row in passes for x in row["added_ms"]]
        wait = [x for row in passes for x in row["wait_ms"]]
        summary[mode] = {
            "hit_ratio": [row["hit_ratio"] for row in passes],
            "ttft_p50_ms": [row["ttft_p50_ms"] for row in passes],
            "ttft_p99_ms": [row["ttft_p99_ms"] for row in passes],
            "added_p50_ms": round(percentile(added, 50), 2),
            "added_p99_ms": round(percentile(added, 99), 2),
            "waited": len(wait),
            "wait_p50_ms": round(percentile(wait, 50), 2) if wait else None,
            "wait_p99_ms": round(percentile(wait, 99), 2) if wait else None,
            "late": sum(row["late"] for row in passes),
            "early_started": sum(row["early_started"] for row in passes),
            "head_start_p50_ms": [row["head_start_p50_ms"] for row in passes],
            "cpu_ms_per_request": [row["process_cpu_ms_per_request"] for row in passes],
        }
        s = summary[mode]
        table.add_row(
            mode,
            str(len(passes)),
            " ".join(f"{x:.3f}" for x in s["hit_ratio"]),
            " ".join(f"{x:.0f}" for x in s["ttft_p50_ms"]),
            " ".join(f"{x:.0f}" for x in s["ttft_p99_ms"]),
            f"{s['added_p50_ms']:.2f}",
            f"{s['added_p99_ms']:.2f}",
            str(s["waited"]),
            str(s["wait_p50_ms"]),
            str(s["wait_p99_ms"]),
            str(s["late"]),
            " ".join(f"{x:.1f}" for x in s["cpu_ms_per_request"]),
        )
    Console().print(table)
    print(json.dumps({"summary": summary}))


if __name__ == "__main__":
    main()
