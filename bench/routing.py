"""Routing policies side by side on 3 real workers: hit ratio, TTFT p50/p99, goodput.

    python -m bench.routing            # 600 requests per policy and workload
    python -m bench.routing --quick    # 150

Three worker processes (``random-small``, the built-in model's shape; ``--threads 1`` each; a small
device pool and no L2 so that where a prefix lives matters) sit behind one in-process gateway that is
rebuilt for each policy: random, round-robin, consistent hash (rendezvous over the first 4 blocks),
least-loaded, KV-aware (the KV-event index), KV-aware + near-miss (tenants opted in; the default: the
namespace's latest prompts checked by tokens, no embedding) and KV-aware + near-miss + FAISS
(``near_miss_max_wait_ms`` 15: the head embedded and searched on the request path), and consistent
hash + near-miss + FAISS (no KV index: near miss is then the only knowledge of where a similar prompt
went). Each policy gets
fresh tenants (fresh namespaces) and every worker's cache is purged between policies.

Workloads (token-id prompts through ``/v1/completions``, streamed, ``max_tokens`` 4):
- ``multi_tenant``: 6 tenants with Zipf traffic, each with 10 system prompts of 8–24 blocks (Zipf),
  then a distinct 1–4 block user part;
- ``near_duplicate``: the same system prompts as templates with 2 fields (a date, a name, an id) at
  block positions drawn once per prompt, uniformly from block 1 to its last block; every request fills
  them with its own 8 tokens (so it shares exactly the blocks before the first field with its
  siblings), and requests come in bursts of 4–8 of one template. Only templates whose first field
  falls inside the router's 4-block affinity window scatter under the cold hash;
- ``near_duplicate_early`` (``bench.near_miss_gain`` only): the same, with every template's first field
  in block 1–3, inside that window: the siblings that only near miss can bring together.
- ``near_duplicate_late`` (``bench.near_miss_gain`` only): the same, with both fields in the template's
  last 2 blocks: siblings share all but the tail (a long document, then a per-request line).

Closed loop with ``--concurrency`` clients. Hit ratio = cached prompt tokens / prompt tokens; goodput =
requests per second whose TTFT met ``--slo-ms``; process CPU per request = this process's CPU time
(clients, gateway, embedding thread) over the policy's run, divided by its requests: what near miss
adds there is CPU the workers lose on a small machine. The embedding cost of near-miss is measured on the
path users run: the gateway's own embedder (int8 ONNX graph unless it could not be built) on the
near_duplicate workload's distinct 128-token heads decoded by the gateway's tokenizer, beside the fp32
sentence-transformers reference on the same heads. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.gateway_overhead import percentile, wait_http
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.embedding import PromptEmbedder
from gateway.state import METRICS, NEAR_MISS, PIPELINE
from gateway.up import free_port
from migrations import upgrade_database

BLOCK = 16
ADMIN = "bench-admin"
POLICIES: dict[str, dict] = {
    "random": {"router": "random", "kv_index": False},
    "round_robin": {"router": "round_robin", "kv_index": False},
    "consistent_hash": {"router": "rendezvous", "kv_index": False},
    "least_loaded": {"router": "least_loaded", "kv_index": False},
    "kv_aware": {"router": "kv_aware", "kv_index": True},
    "kv_aware+near_miss": {"router": "kv_aware", "kv_index": True, "near_miss": True},
    # The FAISS search on the request path too, waiting up to 15 ms for the head's embedding.
    "kv_aware+near_miss+faiss": {
        "router": "kv_aware",
        "kv_index": True,
        "near_miss": True,
        "config": {"near_miss_max_wait_ms": 15.0},
    },
    # Without KV events (external workers, or kv_index off): the exact route is the consistent hash of the
    # first 4 blocks, blind to where a similar prompt went; here near miss is the only prefix knowledge.
    "consistent_hash+near_miss+faiss": {
        "router": "rendezvous",
        "kv_index": False,
        "near_miss": True,
        "config": {"near_miss_max_wait_ms": 15.0},
    },
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    tenant: int
    prompt: list[int]


def zipf_pick(rng: random.Random, n: int, s: float = 1.1) -> int:
    weights = [1 / (k + 1) ** s for k in range(n)]
    return rng.choices(range(n), weights)[0]


def workload(kind: str, num_requests: int, seed: int, num_tenants: int = 6, prompts_per_tenant: int = 5):
    rng = random.Random(seed)
    systems = [
        [
            [rng.randrange(1, 250) for _ in range(BLOCK * rng.randint(8, 24))]
            for _ in range(prompts_per_tenant)
        ]
        for _ in range(num_tenants)
    ]
    # near_duplicate: each system prompt is a template with 2 fields (a date, a user name, an id ...)
    # at fixed block positions, drawn once; every request fills them with its own 8 tokens.
    # (Drawn from their own generator: multi_tenant's requests stay what they were.)
    field_rng = random.Random(seed + 1)
    fields = [
        [sorted(field_rng.sample(range(1, len(s) // BLOCK), 2)) for s in by_tenant] for by_tenant in systems
    ]
    if kind == "near_duplicate_early":  # the first field inside the cold route's 4-block affinity window
        early_rng = random.Random(seed + 2)
        fields = [[[early_rng.randint(1, 3), f[1] if f[1] > 3 else 4] for f in by] for by in fields]
    if kind == "near_duplicate_late":  # both fields in the template's last 2 blocks: a long shared prefix
        fields = [[[len(s) // BLOCK - 2, len(s) // BLOCK - 1] for s in by_tenant] for by_tenant in systems]
    near_duplicate = kind.startswith("near_duplicate")
    requests: list[Request] = []
    while len(requests) < num_requests:
        tenant, which = zipf_pick(rng, num_tenants), zipf_pick(rng, prompts_per_tenant)
        burst = rng.randint(4, 8) if near_duplicate else 1
        for _ in range(burst):
            system = systems[tenant][which]
            if near_duplicate:
                filled: list[int] = []
                start = 0
                for block in fields[tenant][which]:
                    filled += system[start : block * BLOCK] + [rng.randrange(1, 250) for _ in range(8)]
                    start = block * BLOCK
                system = filled + system[start:]
            user = [rng.randrange(1, 250) for _ in range(rng.randint(BLOCK, 4 * BLOCK))]
            requests.append(Request(tenant=tenant, prompt=system + user))
    return requests[:num_requests]


@contextlib.contextmanager
def workers(count: int, num_blocks: int, log_dir: Path):
    procs, urls = [], []
    try:
        for i in range(count):
            port = free_port()
            args = ["--model", "random-small", "--threads", "1", "--num-blocks", str(num_blocks)]
            args += ["--l2-bytes", "0", "--max-model-len", "2048", "--port", str(port)]
            log = open(log_dir / f"worker-{i}.log", "wb")  # noqa: SIM115 - closed with the process
            procs.append(
                (subprocess.Popen([sys.executable, "-m", "worker", *args], stdout=log, stderr=log), log)
            )
            urls.append(f"http://127.0.0.1:{port}")
        for (proc, _), url in zip(procs, urls, strict=True):
            wait_http(url + "/healthz", proc)
        yield urls
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, log in procs:
            proc.wait(timeout=30)
            log.close()


async def start_gateway(urls: list[str], data_dir: Path, settings: dict) -> tuple[web.AppRunner, str]:
    config = GatewayConfig(
        data_dir=data_dir,
        worker_urls=tuple(urls),
        admin_token=ADMIN,
        namespace_salt="bench-salt",
        router=settings["router"],
        kv_index=settings["kv_index"],
        worker_health_interval_s=0.5,
        log_level="WARNING",
        **settings.get("config", {}),
    )
    runner = web.AppRunner(create_app(config), access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def one(session: aiohttp.ClientSession, base: str, key: str, prompt: list[int]) -> tuple[float, dict]:
    body = {"model": "random-small", "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    started = time.perf_counter()
    ttft, usage = None, {}
    async with session.post(
        f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    return (ttft or time.perf_counter() - started), usage


async def run_policy(
    kind: str,
    name: str,
    urls: list[str],
    requests: list[Request],
    args,
    tmp: Path,
    progress,
    settings: dict | None = None,
) -> dict:
    """One policy's pass; ``settings`` (default ``POLICIES[name]``) lets another bench name its own."""
    settings = POLICIES[name] if settings is None else settings
    runner, base = await start_gateway(urls, tmp, settings)
    app = runner.app
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN}"}) as admin:
        tenants = []
        for t in range(max(r.tenant for r in requests) + 1):
            body = {
                "name": f"{kind}-{name}-{t}-{os.urandom(3).hex()}",
                "near_miss_routing": bool(settings.get("near_miss")),
            }
            async with admin.post(f"{base}/admin/v1/tenants", json=body) as r:
                if r.status != 201:
                    raise RuntimeError(f"creating a tenant: {r.status} {await r.text()}")
                tenants.append(await r.json())
        await asyncio.sleep(0.6)  # policy refresh
    faiss = settings.get("config", {}).get("near_miss_max_wait_ms", 0) > 0
    if faiss:
        await app[NEAR_MISS].embedder.warm_up()  # the model load (and export) is a one-off
    results: list[tuple[float, dict]] = []
    queue = list(requests)
    task = progress.add_task(name, total=len(requests))
    started, cpu_started = time.perf_counter(), time.process_time()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client() -> None:
            while queue:
                request = queue.pop(0)
                results.append(await one(session, base, tenants[request.tenant]["api_key"], request.prompt))
                progress.advance(task)

        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - started
        cpu_s = time.process_time() - cpu_started  # this process: clients, gateway, embedding thread
        for tenant in tenants:  # cold caches for the next policy
            for url in urls:
                async with session.post(f"{url}/v1/purge", json={"namespace_id": tenant["namespace_id"]}):
                    pass
    extra = {}
    if settings.get("near_miss"):
        registry = app[METRICS].registry
        name = "prefixgate_near_miss_routes_total"
        extra["near_miss_routes"] = {
            outcome: int(registry.get_sample_value(name, {"outcome": outcome}) or 0)
            for outcome in ("moved", "kept", "late")
        }
        if kind == "near_duplicate" and faiss:
            model = app[PIPELINE].resolve_model("random-small")
            heads = list(dict.fromkeys(model.decode(r.prompt[:128]) for r in requests))
            extra["embedding"] = await asyncio.to_thread(embedding_cost, app[NEAR_MISS].embedder, heads)
    await runner.cleanup()
    ttfts = [ttft * 1000 for ttft, _ in results]
    prompt = sum(u.get("prompt_tokens", 0) for _, u in results)
    cached = sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for _, u in results)
    near = sum(u.get("prefixgate", {}).get("near_miss_tokens", 0) for _, u in results)
    if getattr(args, "keep_ttfts", False):  # bench.near_miss_gain pools passes
        extra["ttfts_ms"] = [round(x, 2) for x in ttfts]
    return {
        "hit_ratio": round(cached / max(1, prompt), 4),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft_p50_ms": round(percentile(ttfts, 50), 1),
        "ttft_p99_ms": round(percentile(ttfts, 99), 1),
        "goodput_rps": round(sum(t <= args.slo_ms for t in ttfts) / elapsed, 2),
        "near_miss_tokens": near,
        "process_cpu_ms_per_request": round(cpu_s * 1000 / max(1, len(results)), 2),
        "requests": len(results),
        **extra,
    }


def embedding_cost(embedder: PromptEmbedder, heads: list[str]) -> dict:
    """Per-head embedding time of the gateway's embedder and of the fp32 reference, side by side."""
    reference = PromptEmbedder(backend="sentence-transformers")
    reference.embed_blocking("warm up")
    ours, theirs = [], []
    for head in heads:  # interleaved, so that machine load hits both alike
        started = time.perf_counter()
        embedder.embed_blocking(head)
        ours.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        reference.embed_blocking(head)
        theirs.append((time.perf_counter() - started) * 1000)
    reference.close()
    return {
        "embed_backend": embedder.backend,
        "embed_heads": len(heads),
        "embed_p50_ms": round(percentile(ours, 50), 2),
        "embed_p99_ms": round(percentile(ours, 99), 2),
        "embed_fp32_p50_ms": round(percentile(theirs, 50), 2),
        "embed_fp32_p99_ms": round(percentile(theirs, 99), 2),
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = list(POLICIES)
    for kind_index, kind in enumerate(results):
        offset = (kind_index - 0.5) * 0.4
        xs = [i + offset for i in range(len(names))]
        axes[0].bar(xs, [results[kind][n]["hit_ratio"] for n in names], width=0.4, label=kind)
        axes[1].bar(xs, [results[kind][n]["ttft_p99_ms"] for n in names], width=0.4, label=kind)
        axes[2].bar(xs, [results[kind][n]["goodput_rps"] for n in names], width=0.4, label=kind)
    for ax, title in zip(axes, ("hit ratio", "TTFT p99 (ms)", "goodput (req/s within SLO)"), strict=True):
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


async def main_async(args) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    num = 150 if args.quick else args.requests
    results: dict[str, dict] = {}
    with (
        tempfile.TemporaryDirectory() as tmp_name,
        workers(3, args.num_blocks, Path(tmp_name)) as urls,
        Progress() as progress,
    ):
        await asyncio.to_thread(
            upgrade_database, GatewayConfig(data_dir=Path(tmp_name)).resolved_database_url
        )
        for kind in ("multi_tenant", "near_duplicate"):
            requests = workload(kind, num, args.seed, prompts_per_tenant=args.prompts_per_tenant)
            results[kind] = {}
            for name in POLICIES:
                results[kind][name] = await run_policy(
                    kind, name, urls, requests, args, Path(tmp_name), progress
                )
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=256, help="device pool per worker")
    parser.add_argument("--slo-ms", type=float, default=250.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts-per-tenant", type=int, default=10, help="system prompts per tenant")
    parser.add_argument("--plot", type=Path, default=Path("docs/img/routing.png"))
    args = parser.parse_args(argv)
    results = asyncio.run(main_async(args))
    cost = results["near_duplicate"]["kv_aware+near_miss+faiss"].pop("embedding")
    console = Console(width=160)  # full policy names also when not on a terminal
    for kind, by_policy in results.items():
        table = Table(
            title=f"routing: {kind} (3 workers, concurrency {args.concurrency}, SLO {args.slo_ms:.0f} ms)"
        )
        columns = (
            "policy",
            "hit ratio",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "goodput req/s",
            "near-miss tok",
            "CPU ms/req",
        )
        for column in columns:
            table.add_column(column, justify="right")
        for name, row in by_policy.items():
            table.add_row(
                name,
                f"{row['hit_ratio']:.3f}",
                f"{row['ttft_p50_ms']:.1f}",
                f"{row['ttft_p99_ms']:.1f}",
                f"{row['goodput_rps']:.2f}",
                str(row["near_miss_tokens"]),
                f"{row['process_cpu_ms_per_request']:.1f}",
            )
        console.print(table)
    mt = results["multi_tenant"]
    nd = results["near_duplicate"]
    summary = {
        "kv_vs_round_robin_hit_ratio": round(
            mt["kv_aware"]["hit_ratio"] / max(1e-9, mt["round_robin"]["hit_ratio"]), 2
        ),
        "kv_vs_consistent_hash_hit_ratio": round(
            mt["kv_aware"]["hit_ratio"] / max(1e-9, mt["consistent_hash"]["hit_ratio"]), 3
        ),
        "kv_vs_least_loaded_ttft_p99": round(
            mt["kv_aware"]["ttft_p99_ms"] / mt["least_loaded"]["ttft_p99_ms"], 2
        ),
        "near_miss_extra_hit_ratio": round(
            nd["kv_aware+near_miss"]["hit_ratio"] - nd["kv_aware"]["hit_ratio"], 4
        ),
        "near_miss_without_kv_index_extra_hit_ratio": round(
            nd["consistent_hash+near_miss+faiss"]["hit_ratio"] - nd["consistent_hash"]["hit_ratio"], 4
        ),
        "near_miss_vs_kv_ttft_p50": round(
            nd["kv_aware+near_miss"]["ttft_p50_ms"] / nd["kv_aware"]["ttft_p50_ms"], 2
        ),
        "near_miss_vs_kv_goodput": round(
            nd["kv_aware+near_miss"]["goodput_rps"] / max(1e-9, nd["kv_aware"]["goodput_rps"]), 2
        ),
        "near_miss_faiss_extra_hit_ratio": round(
            nd["kv_aware+near_miss+faiss"]["hit_ratio"] - nd["kv_aware"]["hit_ratio"], 4
        ),
        "multi_tenant_near_miss_vs_kv_goodput": round(
            mt["kv_aware+near_miss"]["goodput_rps"] / max(1e-9, mt["kv_aware"]["goodput_rps"]), 2
        ),
        "multi_tenant_near_miss_extra_cpu_ms_per_request": round(
            mt["kv_aware+near_miss"]["process_cpu_ms_per_request"]
            - mt["kv_aware"]["process_cpu_ms_per_request"],
            2,
        ),
        **cost,
    }
    console.print(
        f"embedding (all-MiniLM-L6-v2, 1 thread, {cost['embed_heads']} heads of 128 tokens): "
        f"{cost['embed_backend']} p50 {cost['embed_p50_ms']} ms, p99 {cost['embed_p99_ms']} ms; "
        f"fp32 sentence-transformers p50 {cost['embed_fp32_p50_ms']} ms, p99 {cost['embed_fp32_p99_ms']} ms"
    )
    plot(results, args.plot)
    console.print(f"plot: {args.plot}")
    print(json.dumps({"results": results, "summary": summary}))


if __name__ == "__main__":
    main()
