"""What near miss gains on near-duplicate prompts: KV-aware alone vs KV-aware + near miss, side by side.

    python -m bench.near_miss_gain --quick --plot docs/img/near_miss_gain.png   # 150 requests a pass
    python -m bench.near_miss_gain --seeds 0 1 2 --repeats 2                    # 600

``bench.routing``'s 3 workers and in-process gateway (fresh tenants and purged caches per pass), its
workloads ``near_duplicate`` (templates with 2 per-request fields at drawn block positions, bursts of
4–8) and ``near_duplicate_early`` (the first field in block 1–3: the siblings the cold route scatters,
which only near miss can bring together). Policies, in turn within each (workload, seed, pass), the
order rotated from pass to pass: ``kv_aware``, ``kv_aware+near_miss`` (the default near miss: the
namespace's latest prompts by tokens) and ``kv_aware+near_miss+faiss`` (FAISS too, bound 15 ms).

Per policy, pooled over passes: prompt tokens reused (cached tokens the workers reported), the hit
ratio, near-miss tokens (reuse beyond the exact index's prediction on moved requests), moves, TTFT
p50/p99 from the clients. Reuse is exact-token in every policy: near miss only chooses the worker.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import bench.routing as routing_bench
from bench.gateway_overhead import percentile
from gateway.config import GatewayConfig
from migrations import upgrade_database

POLICIES = ("kv_aware", "kv_aware+near_miss", "kv_aware+near_miss+faiss")
WORKLOADS = ("near_duplicate", "near_duplicate_early")


async def run_passes(args) -> dict[str, dict[str, list[dict]]]:
    """rows[workload][policy] = one dict per pass (``bench.routing.run_policy``'s, plus raw TTFTs)."""
    routing_bench.embedding_cost = lambda embedder, heads: {}  # bench.embedding measures the model alone
    num = 150 if args.quick else args.requests
    rows = {kind: {name: [] for name in POLICIES} for kind in WORKLOADS}
    with tempfile.TemporaryDirectory() as tmp_name, Progress() as progress:
        tmp = Path(tmp_name)
        await asyncio.to_thread(upgrade_database, GatewayConfig(data_dir=tmp).resolved_database_url)
        with routing_bench.workers(3, args.num_blocks, tmp) as urls:
            turn = 0
            for rep in range(args.repeats):
                for seed in args.seeds:
                    for kind in WORKLOADS:
                        requests = routing_bench.workload(
                            kind, num, seed, prompts_per_tenant=args.prompts_per_tenant
                        )
                        order = POLICIES[turn % 3 :] + POLICIES[: turn % 3]  # each goes first in turn
                        turn += 1
                        for name in order:
                            row = await routing_bench.run_policy(
                                kind, name, urls, requests, args, tmp, progress
                            )
                            row.pop("embedding", None)
                            row["seed"], row["pass"] = seed, rep
                            rows[kind][name].append(row)
                            brief = {k: v for k, v in row.items() if not isinstance(v, list)}
                            progress.console.print(f"{kind} {name} s{seed}r{rep}: {json.dumps(brief)}")
    return rows


def pooled(passes: list[dict]) -> dict:
    prompt = sum(row["prompt_tokens"] for row in passes)
    cached = sum(row["cached_tokens"] for row in passes)
    ttfts = [x for row in passes for x in row["ttfts_ms"]]
    moves = sum(row.get("near_miss_routes", {}).get("moved", 0) for row in passes)
    return {
        "passes": len(passes),
        "prompt_tokens": prompt,
        "reused_tokens": cached,
        "hit_ratio": round(cached / max(1, prompt), 4),
        "hit_ratio_per_pass": [row["hit_ratio"] for row in passes],
        "near_miss_tokens": sum(row["near_miss_tokens"] for row in passes),
        "moved": moves,
        "ttft_p50_ms": round(percentile(ttfts, 50), 1),
        "ttft_p99_ms": round(percentile(ttfts, 99), 1),
        "ttft_p50_ms_per_pass": [row["ttft_p50_ms"] for row in passes],
    }


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    width = 0.25
    for i, name in enumerate(POLICIES):
        xs = [k + (i - 1) * width for k in range(len(WORKLOADS))]
        axes[0].bar(xs, [summary[kind][name]["reused_tokens"] for kind in WORKLOADS], width, label=name)
        axes[1].bar(xs, [summary[kind][name]["near_miss_tokens"] for kind in WORKLOADS], width, label=name)
        axes[2].bar(xs, [summary[kind][name]["ttft_p50_ms"] for kind in WORKLOADS], width, label=name)
    titles = ("prompt tokens reused (pooled)", "near-miss tokens (pooled)", "TTFT p50 ms (pooled)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xticks(range(len(WORKLOADS)), WORKLOADS)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
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
    rows = asyncio.run(run_passes(args))
    summary = {kind: {name: pooled(passes) for name, passes in by.items()} for kind, by in rows.items()}
    console = Console(width=180)
    for kind, by in summary.items():
        table = Table(title=f"{kind}: pooled over {by['kv_aware']['passes']} passes per policy")
        for column in ("policy", "reused tokens", "hit ratio", "per pass", "near-miss tok", "moved"):
            table.add_column(column, justify="right")
        for column in ("TTFT p50", "TTFT p99", "p50 per pass"):
            table.add_column(column, justify="right")
        for name, s in by.items():
            table.add_row(
                name,
                f"{s['reused_tokens']} / {s['prompt_tokens']}",
                f"{s['hit_ratio']:.4f}",
                " ".join(f"{x:.3f}" for x in s["hit_ratio_per_pass"]),
                str(s["near_miss_tokens"]),
                str(s["moved"]),
                f"{s['ttft_p50_ms']:.0f}",
                f"{s['ttft_p99_ms']:.0f}",
                " ".join(f"{x:.0f}" for x in s["ttft_p50_ms_per_pass"]),
            )
        console.print(table)
    plot(summary, args.plot)
    console.print(f"plot: {args.plot}")
    print(json.dumps({"summary": summary}))


if __name__ == "__main__":
    main()
