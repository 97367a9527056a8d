"""Load and overload: N streaming clients for T seconds through the real gateway and worker processes.

    python -m bench.load [--quick] [--clients-per-slot 16] [--levels 1,4]

Starts one worker (``random-tiny``, ``--max-num-seqs`` = its batch) and two gateway processes on SQLite
in a temporary data dir, both in front of that worker:

- ``bounded``: the gateway's backpressure as shipped (``max_in_flight`` = 1.5 x the worker's batch,
  tenants limited to ``max_concurrent_requests``), answering the excess 429/503 with Retry-After;
- ``unbounded``: ``max_in_flight = 0`` and no tenant limits, which is how the gateway behaved before.

For each load level (1x = as many clients as the worker's batch, 4x = four times as many), clients of
four tenants send streamed chat requests of mixed prompt sizes back to back for T seconds, each with a
client timeout; a refused client waits its Retry-After (at most 1 s) and tries again. Reported per run:
answers completed per second, goodput (answers whose first token came within the TTFT SLO, ``--slo-s``,
per second: the serving literature's definition, which an answer too late to be useful does not count
towards), status counts (200, 429, 503, timeout, error), p50/p99 TTFT of
the answers, p99 time to a refusal, and RSS growth of the gateway and the worker. The last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from tqdm import tqdm

from bench.gateway_overhead import percentile, wait_http
from gateway.up import free_port

ADMIN_TOKEN = "bench-admin"
MODEL = "random-tiny"
NUM_TENANTS = 4
PROMPT_CHARS = (60, 600, 2000)  # short, medium, long (byte-level tokenizer: ~1 token per character)
MAX_TOKENS = 32


@dataclass(slots=True)
class RunStats:
    duration_s: float = 0.0
    statuses: Counter[str] = field(default_factory=Counter)
    ttft_s: list[float] = field(default_factory=list)
    refusal_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0

    def summary(self, slo_s: float) -> dict:
        served = self.statuses["200"]
        total = sum(self.statuses.values()) or 1
        within_slo = sum(1 for ttft in self.ttft_s if ttft <= slo_s)
        return {
            "answers_rps": round(served / self.duration_s, 2),
            "goodput_rps": round(within_slo / self.duration_s, 2),  # TTFT within the SLO
            "tokens_per_s": round(self.completion_tokens / self.duration_s, 1),
            "statuses": dict(sorted(self.statuses.items())),
            "error_rate": round(1 - served / total, 3),
            "timeouts": self.statuses["timeout"],
            "ttft_p50_s": round(percentile(self.ttft_s, 50), 3) if self.ttft_s else None,
            "ttft_p99_s": round(percentile(self.ttft_s, 99), 3) if self.ttft_s else None,
            "refusal_p99_s": round(percentile(self.refusal_s, 99), 4) if self.refusal_s else None,
        }


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def prompt(rng: random.Random, client_id: int) -> str:
    size = rng.choice(PROMPT_CHARS)
    head = f"Client {client_id} asks about prefix caching. "  # distinct per client: little cache reuse
    return (head + "Context line about KV blocks and tiered stores. " * (size // 48 + 1))[:size]


async def client(
    session: aiohttp.ClientSession,
    url: str,
    key: str,
    client_id: int,
    deadline: float,
    timeout_s: float,
    stats: RunStats,
) -> None:
    rng = random.Random(client_id)
    headers = {"Authorization": f"Bearer {key}"}
    while time.monotonic() < deadline:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt(rng, client_id)}],
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
        }
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                async with session.post(url, json=body, headers=headers) as response:
                    if response.status != 200:
                        await response.read()
                        stats.refusal_s.append(time.perf_counter() - started)
                        stats.statuses[str(response.status)] += 1
                        retry_s = min(1.0, float(response.headers.get("Retry-After", "1")))
                        await asyncio.sleep(retry_s * rng.uniform(0.5, 1.0))
                        continue
                    first, chunks = None, 0
                    async for line in response.content:
                        if line.startswith(b"data: {"):
                            first = first or time.perf_counter()
                            chunks += 1
                    stats.ttft_s.append((first or time.perf_counter()) - started)
                    stats.completion_tokens += max(0, chunks - 2)  # role chunk and final chunk
                    stats.statuses["200"] += 1
        except TimeoutError:
            stats.statuses["timeout"] += 1
        except aiohttp.ClientError:
            stats.statuses["error"] += 1


async def run_level(
    gateway_url: str, keys: list[str], num_clients: int, duration_s: float, timeout_s: float, label: str
) -> RunStats:
    stats = RunStats()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        url = gateway_url + "/v1/chat/completions"
        started = time.monotonic()
        deadline = started + duration_s
        tasks = [
            asyncio.create_task(client(session, url, keys[i % len(keys)], i, deadline, timeout_s, stats))
            for i in range(num_clients)
        ]
        with tqdm(total=int(duration_s), desc=label, unit="s", file=sys.stderr, leave=False) as bar:
            while time.monotonic() < deadline:
                await asyncio.sleep(1)
                bar.update(1)
                bar.set_postfix(ok=stats.statuses["200"], refused=len(stats.refusal_s))
        await asyncio.gather(*tasks)
        stats.duration_s = time.monotonic() - started
    return stats


def create_tenants(gateway_url: str, limit: int | None) -> list[str]:
    import urllib.request

    keys = []
    for i in range(NUM_TENANTS):
        fields = {"name": f"load-{i}", "canonicalization": "report"}
        if limit:
            fields["max_concurrent_requests"] = limit
        request = urllib.request.Request(
            gateway_url + "/admin/v1/tenants",
            data=json.dumps(fields).encode(),
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            keys.append(json.loads(response.read())["api_key"])
    return keys


def start_gateway(data_dir: Path, worker_url: str, max_in_flight: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {
        **os.environ,
        "PREFIXGATE_ADMIN_TOKEN": ADMIN_TOKEN,
        "PREFIXGATE_NAMESPACE_SALT": "bench-salt",
        "PREFIXGATE_LOG_LEVEL": "WARNING",
        "PREFIXGATE_DATA_DIR": str(data_dir),
        "PREFIXGATE_MAX_IN_FLIGHT": str(max_in_flight),
    }
    subprocess.run(
        [sys.executable, "-m", "gateway", "db", "upgrade"], env=env, check=True, stdout=subprocess.DEVNULL
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "gateway", "--port", str(port), "--worker-url", worker_url],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return process, f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 s per run instead of 30 s")
    parser.add_argument("--batch", type=int, default=16, help="the worker's --max-num-seqs (1x clients)")
    parser.add_argument("--levels", default="1,4", help="load levels, in multiples of --batch")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="client timeout per request")
    parser.add_argument("--plot", type=Path, default=None, help="write a TTFT CDF per run (PNG)")
    parser.add_argument("--slo-s", type=float, default=1.0, help="TTFT SLO of goodput (default 1 s)")
    args = parser.parse_args()
    duration_s = 10.0 if args.quick else 30.0
    levels = [int(level) for level in args.levels.split(",")]
    started = time.monotonic()
    results: dict[str, dict] = {}
    ttfts: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="pg-load-") as tmp:
        worker_port = free_port()
        worker_url = f"http://127.0.0.1:{worker_port}"
        worker = subprocess.Popen(
            [
                *(sys.executable, "-m", "worker", "--model", MODEL, "--port", str(worker_port)),
                *("--max-num-seqs", str(args.batch), "--data-dir", str(Path(tmp) / "worker")),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        bounded, bounded_url = start_gateway(Path(tmp) / "bounded", worker_url, args.batch * 3 // 2)
        unbounded, unbounded_url = start_gateway(Path(tmp) / "unbounded", worker_url, 0)
        processes = [worker, bounded, unbounded]
        try:
            wait_http(worker_url + "/healthz", worker)
            for process, url in ((bounded, bounded_url), (unbounded, unbounded_url)):
                wait_http(url + "/healthz", process)
            keys = {
                "bounded": create_tenants(bounded_url, max(1, args.batch // 2)),
                "unbounded": create_tenants(unbounded_url, None),
            }
            urls = {"bounded": bounded_url, "unbounded": unbounded_url}
            pids = {"bounded": bounded.pid, "unbounded": unbounded.pid}
            for level in levels:
                for mode in ("bounded", "unbounded"):
                    label = f"{mode} {level}x"
                    rss_before = rss_bytes(pids[mode]), rss_bytes(worker.pid)
                    stats = asyncio.run(
                        run_level(
                            urls[mode], keys[mode], level * args.batch, duration_s, args.timeout_s, label
                        )
                    )
                    rss_after = rss_bytes(pids[mode]), rss_bytes(worker.pid)
                    ttfts[label] = stats.ttft_s
                    results[label] = {
                        "clients": level * args.batch,
                        **stats.summary(args.slo_s),
                        "gateway_rss_growth_mb": round((rss_after[0] - rss_before[0]) / 2**20, 1),
                        "worker_rss_growth_mb": round((rss_after[1] - rss_before[1]) / 2**20, 1),
                    }
                    time.sleep(2)  # let the worker drain what the clients left behind
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
    header = (
        f"{'run':<14}{'clients':>8}{'answers/s':>10}{'goodput/s':>10}{'tok/s':>8}{'200':>6}{'429':>6}{'503':>6}"
        f"{'timeout':>8}{'error':>6}{'ttft p50':>9}{'ttft p99':>9}{'refuse p99':>11}{'gw rss+':>8}"
    )
    print(header)
    for label, r in results.items():
        s = r["statuses"]
        ttft50 = f"{r['ttft_p50_s']:.2f}s" if r["ttft_p50_s"] is not None else "-"
        ttft99 = f"{r['ttft_p99_s']:.2f}s" if r["ttft_p99_s"] is not None else "-"
        refuse = f"{r['refusal_p99_s'] * 1000:.0f}ms" if r["refusal_p99_s"] is not None else "-"
        print(
            f"{label:<14}{r['clients']:>8}{r['answers_rps']:>10.1f}{r['goodput_rps']:>10.1f}{r['tokens_per_s']:>8.0f}"
            f"{s.get('200', 0):>6}{s.get('429', 0):>6}{s.get('503', 0):>6}{s.get('timeout', 0):>8}"
            f"{s.get('error', 0):>6}{ttft50:>9}{ttft99:>9}{refuse:>11}{r['gateway_rss_growth_mb']:>7.1f}M"
        )
    top = max(levels)
    ratio = {}
    if 1 in levels and top != 1:
        ratio = {
            f"{mode}_{kind}_{top}x_over_1x": round(
                results[f"{mode} {top}x"][f"{kind}_rps"] / (results[f"{mode} 1x"][f"{kind}_rps"] or 1), 2
            )
            for mode in ("bounded", "unbounded")
            for kind in ("answers", "goodput")
        }
    print(
        f"(model {MODEL}, batch {args.batch}, {duration_s:.0f} s per run, "
        f"goodput = TTFT <= {args.slo_s:g} s, {time.monotonic() - started:.0f} s)"
    )
    if args.plot:
        plot_ttft(ttfts, args.plot, args.timeout_s)
    print(json.dumps({"runs": results, **ratio}))


def plot_ttft(ttfts: dict[str, list[float]], path: Path, timeout_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for label, values in ttfts.items():
        if values:
            ordered = sorted(values)
            axes.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)
    axes.axvline(timeout_s, color="grey", linestyle=":", label="client timeout")
    axes.set_xscale("log")
    axes.set_xlabel("time to first token of served requests (s)")
    axes.set_ylabel("fraction of served requests")
    axes.set_title("bench.load: TTFT, bounded (429/503) vs unbounded gateway")
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
