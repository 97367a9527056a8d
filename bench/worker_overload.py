"""A worker at 4x overload, with and without its bounded waiting queue (issue 9).

    python -m bench.worker_overload [--quick]

Closed-loop streaming clients hit one real worker process (``--max-num-seqs`` slots, so ``clients`` =
4 x slots is 4x overload). Each client sends a request, waits for it to finish (or for its own timeout,
8 s like the issue's clients), and starts the next; a 503 is answered at once and the client retries after
a short pause. Both configurations run one after the other in the same process on the same load: the
unbounded queue (``--max-waiting-requests 0 --max-waiting-tokens 0``, main's behaviour) and the default
bound. Reported per configuration: completed requests (goodput), client timeouts, 503s and how fast they
came, TTFT p50/p99 of completed requests. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from tests.worker_process import worker_process

KEY = "00112233445566778899aabbccddeeff"
RETRY_PAUSE_S = 0.25


@dataclass(slots=True)
class Tally:
    ok: int = 0
    timeouts: int = 0
    shed: int = 0
    errors: int = 0
    ttft_s: list[float] = field(default_factory=list)
    shed_latency_s: list[float] = field(default_factory=list)


def _payload(rid: str, prompt: list[int], max_tokens: int) -> dict:
    return {
        "request_id": rid,
        "prompt_token_ids": prompt,
        "namespace": [{"start_token": 0, "namespace_id": "bench", "key": KEY}],
        "sampling": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        "stream": True,
        "cache": False,  # every request costs a full prefill: no help from the prefix cache
    }


async def _one(s: aiohttp.ClientSession, url: str, payload: dict, timeout_s: float, tally: Tally) -> None:
    start = time.perf_counter()
    first: float | None = None
    try:
        async with asyncio.timeout(timeout_s):
            async with s.post(f"{url}/v1/generate", json=payload) as response:
                if response.status == 503:
                    await response.read()
                    tally.shed += 1
                    tally.shed_latency_s.append(time.perf_counter() - start)
                    await asyncio.sleep(RETRY_PAUSE_S)
                    return
                if response.status != 200:
                    tally.errors += 1
                    return
                async for line in response.content:
                    if line.strip() and first is None:
                        first = time.perf_counter()
        tally.ok += 1
        tally.ttft_s.append((first or time.perf_counter()) - start)
    except TimeoutError:
        tally.timeouts += 1


async def _load(
    url: str,
    *,
    clients: int,
    duration_s: float,
    prompt_tokens: int,
    max_tokens: int,
    timeout_s: float,
    label: str,
    progress: Progress,
) -> Tally:
    tally = Tally()
    rng = random.Random(7)
    deadline = time.monotonic() + duration_s
    task = progress.add_task(label, total=duration_s)

    async def client(c: int, s: aiohttp.ClientSession) -> None:
        n = 0
        while time.monotonic() < deadline:
            prompt = [rng.randrange(256) for _ in range(prompt_tokens)]
            await _one(s, url, _payload(f"{label}-{c}-{n}", prompt, max_tokens), timeout_s, tally)
            n += 1

    async def tick() -> None:
        while time.monotonic() < deadline:
            progress.update(task, completed=duration_s - max(0.0, deadline - time.monotonic()))
            await asyncio.sleep(0.5)
        progress.update(task, completed=duration_s)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        await asyncio.gather(tick(), *(client(c, s) for c in range(clients)))
    return tally


def _pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def _round(value: float | None, scale: float, digits: int) -> float | None:
    return None if value is None else round(value * scale, digits)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="20 s per configuration")
    parser.add_argument("--model", default="random-small")
    parser.add_argument("--slots", type=int, default=8, help="worker --max-num-seqs")
    parser.add_argument("--overload", type=int, default=4, help="clients = overload x slots")
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=8.0)
    args = parser.parse_args()
    duration_s = 20.0 if args.quick else args.duration_s
    clients = args.overload * args.slots
    configs = {
        "unbounded": ["--max-waiting-requests", "0", "--max-waiting-tokens", "0"],
        "bounded": ["--max-waiting-requests", str(args.slots)],
    }
    console = Console(stderr=True)
    results: dict[str, dict] = {}
    with Progress(console=console) as progress:
        for label, extra in configs.items():
            worker_args = [
                "--model",
                args.model,
                "--max-num-seqs",
                str(args.slots),
                "--l2-bytes",
                "0",
                *extra,
            ]
            with worker_process(*worker_args, log_path=Path(f"/tmp/bench-overload-{label}.log")) as url:
                tally = asyncio.run(
                    _load(
                        url,
                        clients=clients,
                        duration_s=duration_s,
                        prompt_tokens=args.prompt_tokens,
                        max_tokens=args.max_tokens,
                        timeout_s=args.timeout_s,
                        label=label,
                        progress=progress,
                    )
                )
            results[label] = {
                "completed": tally.ok,
                "goodput_rps": round(tally.ok / duration_s, 2),
                "timeouts": tally.timeouts,
                "shed_503": tally.shed,
                "errors": tally.errors,
                "shed_p50_ms": _round(_pct(tally.shed_latency_s, 50), 1000, 1),
                "ttft_p50_s": _round(_pct(tally.ttft_s, 50), 1, 3),
                "ttft_p99_s": _round(_pct(tally.ttft_s, 99), 1, 3),
            }
    table = Table(
        title=f"worker at {args.overload}x overload ({clients} clients, {args.slots} slots, "
        f"{args.timeout_s:.0f} s client timeout, {duration_s:.0f} s each)"
    )
    table.add_column("metric")
    for label in results:
        table.add_column(label, justify="right")
    for metric in results["unbounded"]:
        table.add_row(metric, *(str(results[label][metric]) for label in results))
    Console().print(table)
    ratio = results["bounded"]["goodput_rps"] / max(results["unbounded"]["goodput_rps"], 1e-9)
    print(
        json.dumps(
            {
                "clients": clients,
                "slots": args.slots,
                "duration_s": duration_s,
                "goodput_ratio_bounded_over_unbounded": round(ratio, 2),
                **results,
            }
        )
    )


if __name__ == "__main__":
    main()
