"""What near miss with FAISS adds to a request's path: the embedding wait, before and after branch route9.

    python -m bench.near_miss_path --quick                 # 150 requests per pass, 2 passes per mode
    python -m bench.near_miss_path --repeats 3 --seeds 0 1

``bench.routing``'s 3 workers and in-process gateway, the ``kv_aware+near_miss+faiss`` policy
(``near_miss_max_wait_ms`` 15) on its ``near_duplicate`` workload, two modes alternating pass by pass:
- ``now``: the gateway as it is: a head whose text or word pieces the tenant had embedded is at hand
  on the loop (``PromptEmbedder.at_hand``), and the bound is a deadline from the request's arrival,
  checked when the wait ends;
  with the KV-aware router over the KV-event index, a request searches FAISS only when the index
  cannot see what it could find (``NearMissRouting._beyond_the_index``);
- ``before``: the same code with the three changes of branch route9 undone in this process: only the
  head's text is looked up on the loop (``PromptEmbedder.cached``; the word pieces in the embedding
  thread, after the hand-off), the bound counts from when near miss starts to wait, and every request
  the latest prompts do not cover searches FAISS;
- ``now_no_index``: ``now`` with the rendezvous router and no KV-event index (external workers), where
  FAISS is the only knowledge of where an older similar prompt went and every such request searches.
(At commit a54b3c1, reverted, this bench compared an early and a late start of the embedding instead.)

Measured in the gateway's process, per request of the near-miss tenants (every request here):
- ``added``: the time the request spends in ``NearMissRouting.route`` (nominate, verify on tokens, get
  the embedding when it searches FAISS). Requests that need no search count with their small cost;
- ``searched``: the requests that searched FAISS, and the time they took to get their vector (or to
  give up on it): ``at hand`` ones (no wait), the others;
- ``wait``: of those, the ones that waited for the embedding thread (not at hand, the deadline not yet
  gone), the time waited, and how many came back ``late``; ``expired``: the deadline had gone before
  the wait could begin (``now`` only);
- TTFT p50/p99 from the clients, hit ratio and this process's CPU per request, as in ``bench.routing``.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
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
from gateway.embedding import PromptEmbedder
from gateway.near_miss import NearMissRouting
from migrations import upgrade_database

FAISS = {"near_miss": True, "config": {"near_miss_max_wait_ms": 15.0}}
MODES = {
    "now": {"router": "kv_aware", "kv_index": True, **FAISS},
    "before": {"router": "kv_aware", "kv_index": True, **FAISS},
    "now_no_index": {"router": "rendezvous", "kv_index": False, **FAISS},
}
SAMPLES: dict[str, list[float]] = {"added": [], "searched": [], "at_hand": [], "wait": [], "late": []}
COUNTS = {"expired": 0}
PATCHED = {"before": False}  # the mode of the pass that runs now
AT_HAND: contextvars.ContextVar[bool | None] = contextvars.ContextVar("at_hand", default=None)
SUBMITTED: contextvars.ContextVar[bool] = contextvars.ContextVar("submitted", default=False)


def instrument() -> None:
    """Time ``route`` and the embedding wait inside it (milliseconds); undo route9 in ``before`` passes."""
    route, wait = NearMissRouting.route, NearMissRouting._embed_within_bound
    beyond_the_index = NearMissRouting._beyond_the_index
    at_hand, embed = PromptEmbedder.at_hand, PromptEmbedder.embed

    def patched_at_hand(self, text, *, tenant=""):
        vector = self.cached(text, tenant=tenant) if PATCHED["before"] else at_hand(self, text, tenant=tenant)
        AT_HAND.set(vector is not None)
        return vector

    def patched_embed(self, text, *, urgent=True, tenant=""):
        if urgent:
            SUBMITTED.set(True)
        return embed(self, text, urgent=urgent, tenant=tenant)

    async def timed_route(self, tenant, model, token_ids, segments, request, exact_url, **kwargs):
        if PATCHED["before"]:
            kwargs.pop("arrived_s", None)  # the bound from when near miss starts to wait
        began = time.perf_counter()
        try:
            return await route(self, tenant, model, token_ids, segments, request, exact_url, **kwargs)
        finally:
            SAMPLES["added"].append((time.perf_counter() - began) * 1000)

    async def timed_wait(self, head, tenant_id, deadline_s):
        at_hand_token, submitted_token = AT_HAND.set(None), SUBMITTED.set(False)
        began = time.perf_counter()
        vector = await wait(self, head, tenant_id, deadline_s)
        spent = (time.perf_counter() - began) * 1000
        found, submitted = AT_HAND.get(), SUBMITTED.get()
        AT_HAND.reset(at_hand_token)
        SUBMITTED.reset(submitted_token)
        SAMPLES["searched"].append(spent)
        if found:
            SAMPLES["at_hand"].append(spent)
        elif submitted:
            SAMPLES["wait"].append(spent)
            SAMPLES["late"].append(float(vector is None))
        else:
            COUNTS["expired"] += 1
        return vector

    def patched_beyond_the_index(self, model_id, segments):
        return True if PATCHED["before"] else beyond_the_index(self, model_id, segments)

    NearMissRouting._beyond_the_index = patched_beyond_the_index  # type: ignore[method-assign]
    PromptEmbedder.at_hand = patched_at_hand  # type: ignore[method-assign]
    PromptEmbedder.embed = patched_embed  # type: ignore[method-assign]
    NearMissRouting.route = timed_route  # type: ignore[method-assign]
    NearMissRouting._embed_within_bound = timed_wait  # type: ignore[method-assign]


async def main_async(args) -> dict:
    instrument()
    routing_bench.embedding_cost = lambda embedder, heads: {}  # bench.embedding measures the model alone
    routing_bench.POLICIES.update(MODES)
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
                    for mode in list(MODES) if rep % 2 == 0 else reversed(MODES):  # alternate the order
                        for samples in SAMPLES.values():
                            samples.clear()
                        COUNTS["expired"] = 0
                        PATCHED["before"] = mode == "before"
                        row = await routing_bench.run_policy(
                            "near_duplicate", mode, urls, requests, args, tmp, progress
                        )
                        row.pop("embedding", None)
                        row.update(summarize(SAMPLES))
                        row["seed"], row["pass"] = seed, rep
                        rows[mode].append(row)
                        brief = {k: v for k, v in row.items() if not isinstance(v, list)}
                        progress.console.print(f"{mode} s{seed}r{rep}: {json.dumps(brief)}")
    return rows


def p(values: list[float], q: float) -> float | None:
    return round(percentile(values, q), 2) if values else None


def summarize(samples: dict[str, list[float]]) -> dict:
    added, wait, searched = samples["added"], samples["wait"], samples["searched"]
    return {
        "near_miss_requests": len(added),
        "added_p50_ms": p(added, 50),
        "added_p99_ms": p(added, 99),
        "searched": len(searched),
        "at_hand": len(samples["at_hand"]),
        "searched_p50_ms": p(searched, 50),
        "waited": len(wait),
        "wait_p50_ms": p(wait, 50),
        "wait_p99_ms": p(wait, 99),
        "late": int(sum(samples["late"])),
        "expired": COUNTS["expired"],
        # to pool passes
        "added_ms": [round(x, 2) for x in added],
        "searched_ms": [round(x, 2) for x in searched],
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
    columns = ("mode", "passes", "hit ratio", "TTFT p50", "added p50", "added p99", "searched", "at hand")
    columns += ("searched p50", "waited", "wait p50", "wait p99", "late", "expired", "CPU ms/req")
    for column in columns:
        table.add_column(column)
    summary: dict[str, dict] = {}
    for mode, passes in rows.items():
        pooled = {
            key: [x for row in passes for x in row[f"{key}_ms"]] for key in ("added", "searched", "wait")
        }
        summary[mode] = {
            "hit_ratio": [row["hit_ratio"] for row in passes],
            "ttft_p50_ms": [row["ttft_p50_ms"] for row in passes],
            "ttft_p99_ms": [row["ttft_p99_ms"] for row in passes],
            "added_p50_ms": p(pooled["added"], 50),
            "added_p99_ms": p(pooled["added"], 99),
            "searched": len(pooled["searched"]),
            "at_hand": sum(row["at_hand"] for row in passes),
            "searched_p50_ms": p(pooled["searched"], 50),
            "waited": len(pooled["wait"]),
            "wait_p50_ms": p(pooled["wait"], 50),
            "wait_p99_ms": p(pooled["wait"], 99),
            "late": sum(row["late"] for row in passes),
            "expired": sum(row["expired"] for row in passes),
            "cpu_ms_per_request": [row["process_cpu_ms_per_request"] for row in passes],
        }
        s = summary[mode]
        table.add_row(
            mode,
            str(len(passes)),
            " ".join(f"{x:.3f}" for x in s["hit_ratio"]),
            " ".join(f"{x:.0f}" for x in s["ttft_p50_ms"]),
            str(s["added_p50_ms"]),
            str(s["added_p99_ms"]),
            str(s["searched"]),
            str(s["at_hand"]),
            str(s["searched_p50_ms"]),
            str(s["waited"]),
            str(s["wait_p50_ms"]),
            str(s["wait_p99_ms"]),
            str(s["late"]),
            str(s["expired"]),
            " ".join(f"{x:.1f}" for x in s["cpu_ms_per_request"]),
        )
    Console(width=200).print(table)
    print(json.dumps({"summary": summary}))


if __name__ == "__main__":
    main()
