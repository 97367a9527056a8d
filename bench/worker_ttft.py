"""TTFT with and without a cached context, and aggregate decode throughput, through a real worker.

    python -m bench.worker_ttft [--quick]

For each prompt length: a fresh random context plus a 64-token question. "miss" sends it with nothing
cached; "hit" sends the same context with another question once the first one cached it. TTFT is measured
at the client (time to the first streamed token over HTTP). The ideal speedup is the ratio of the FLOPs of
the two prefills (``ModelConfig.prefill_flops``). Decode throughput: N concurrent streams, tokens generated
after each stream's first token over the wall time of that phase. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from tests.worker_process import worker_process
from worker.model.presets import RANDOM_PRESETS

QUESTION_TOKENS = 64


def _payload(rid: str, prompt: list[int], key: str, max_tokens: int) -> dict:
    return {
        "request_id": rid,
        "prompt_token_ids": prompt,
        "namespace": [{"start_token": 0, "namespace_id": "bench", "key": key}],
        "sampling": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }


async def _stream(session: aiohttp.ClientSession, url: str, payload: dict) -> tuple[float, list[float], dict]:
    """Send one streamed request; returns (ttft_s, token arrival times, final usage)."""
    start = time.perf_counter()
    times: list[float] = []
    usage: dict = {}
    async with session.post(f"{url}/v1/generate", json=payload) as response:
        if response.status != 200:
            raise RuntimeError(await response.text())
        async for line in response.content:
            if not line.strip():
                continue
            message = json.loads(line)
            times.append(time.perf_counter())
            if message["type"] == "error":
                raise RuntimeError(message["error"]["message"])
            if message["type"] == "final":
                usage = message["usage"]
    return times[0] - start, times, usage


async def measure_ttft(
    url: str, lengths: list[int], reps: int, rng: random.Random, progress: Progress
) -> list[dict]:
    def tokens(n: int) -> list[int]:
        return [rng.randrange(256) for _ in range(n)]

    results = []
    task = progress.add_task("TTFT", total=len(lengths) * reps)
    async with aiohttp.ClientSession() as session:
        for length in lengths:
            misses, hits, cached = [], [], 0
            for rep in range(reps):
                key = f"{rng.getrandbits(128):032x}"
                context = tokens(length - QUESTION_TOKENS)
                miss, _, _ = await _stream(
                    session, url, _payload(f"m{length}-{rep}", context + tokens(QUESTION_TOKENS), key, 1)
                )
                hit, _, usage = await _stream(
                    session, url, _payload(f"h{length}-{rep}", context + tokens(QUESTION_TOKENS), key, 1)
                )
                misses.append(miss)
                hits.append(hit)
                cached = usage["cached_tokens"]
                progress.advance(task)
            results.append(
                {
                    "prompt_tokens": length,
                    "cached_tokens": cached,
                    "ttft_miss_ms": statistics.median(misses) * 1000,
                    "ttft_hit_ms": statistics.median(hits) * 1000,
                }
            )
    return results


async def measure_decode(
    url: str, concurrencies: list[int], num_tokens: int, progress: Progress
) -> dict[str, float]:
    out = {}
    task = progress.add_task("decode", total=len(concurrencies))
    async with aiohttp.ClientSession() as session:
        for n in concurrencies:
            payloads = [
                _payload(f"d{n}-{i}", [(i * 31 + j) % 256 for j in range(32)], f"{i:032x}", num_tokens)
                for i in range(n)
            ]
            runs = await asyncio.gather(*(_stream(session, url, p) for p in payloads))
            first = min(times[0] for _, times, _ in runs)
            last = max(times[-1] for _, times, _ in runs)
            out[str(n)] = sum(len(times) - 1 for _, times, _ in runs) / (last - first)
            progress.advance(task)
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['prompt_tokens'] // 1024}k" for r in results]
    xs = range(len(results))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([x - 0.2 for x in xs], [r["ttft_miss_ms"] for r in results], 0.4, label="nothing cached")
    ax.bar([x + 0.2 for x in xs], [r["ttft_hit_ms"] for r in results], 0.4, label="context cached")
    ax.set_xticks(list(xs), labels)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens (context + 64-token question)")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.set_title("prefixgate worker: TTFT miss vs hit")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1k and 4k only, one repetition (under 60 s)")
    parser.add_argument("--model", default="random-bench", help="worker --model (default: the bench preset)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="worker --threads (0: one per core)")
    parser.add_argument("--plot", type=Path, default=Path("bench/out/worker_ttft.png"))
    args = parser.parse_args()
    lengths = [1024, 4096] if args.quick else [1024, 4096, 16384]
    reps = 1 if args.quick else args.reps
    decode_tokens = 32 if args.quick else args.decode_tokens
    console = Console(stderr=True)
    cfg = RANDOM_PRESETS[args.model.removeprefix("random-")] if args.model.startswith("random-") else None
    worker_args = [
        "--model",
        args.model,
        "--max-model-len",
        str(max(lengths) + 128),
        "--num-blocks",
        str(3 * max(lengths) // 16 + 64),
        "--threads",
        str(args.threads),
    ]
    rng = random.Random(0)
    with worker_process(*worker_args) as url, Progress(console=console, transient=True) as progress:
        results = asyncio.run(measure_ttft(url, lengths, reps, rng, progress))
        decode = asyncio.run(measure_decode(url, [1, 4, 16], decode_tokens, progress))
    for r in results:
        r["speedup"] = r["ttft_miss_ms"] / r["ttft_hit_ms"]
        if cfg is not None:
            new = r["prompt_tokens"] - r["cached_tokens"]
            r["ideal_speedup"] = cfg.prefill_flops(r["prompt_tokens"]) / cfg.prefill_flops(
                new, r["cached_tokens"]
            )
    table = Table(title=f"worker TTFT ({args.model})")
    for column in ("prompt", "cached", "miss ms", "hit ms", "speedup", "ideal", "speedup/ideal"):
        table.add_column(column, justify="right")
    for r in results:
        ideal = r.get("ideal_speedup", float("nan"))
        table.add_row(
            str(r["prompt_tokens"]),
            str(r["cached_tokens"]),
            f"{r['ttft_miss_ms']:.1f}",
            f"{r['ttft_hit_ms']:.1f}",
            f"{r['speedup']:.1f}x",
            f"{ideal:.1f}x",
            f"{r['speedup'] / ideal:.2f}",
        )
    Console().print(table)
    decode_table = Table(title="aggregate decode throughput")
    decode_table.add_column("concurrent sequences", justify="right")
    decode_table.add_column("tokens/s", justify="right")
    decode_table.add_column("vs 1", justify="right")
    for n, rate in decode.items():
        decode_table.add_row(n, f"{rate:.1f}", f"{rate / decode['1']:.1f}x")
    Console().print(decode_table)
    plot(results, args.plot)
    Console().print(f"plot: {args.plot}")
    rounded = [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in results]
    print(json.dumps({"results": rounded, "decode_tok_s": {k: round(v, 1) for k, v in decode.items()}}))


if __name__ == "__main__":
    main()
