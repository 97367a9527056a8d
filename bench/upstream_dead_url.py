"""What a dead URL among an ``openai`` upstream's replicas costs, without and with its circuit breaker.

    python -m bench.upstream_dead_url [--requests N]

Starts a worker (``random-tiny``) and an upstream prefixgate gateway in front of it (the healthy
replica), plus a black-holed URL: a listening socket whose accept queue is full, so connections to it
time out (a host that went away). Two front gateways list both URLs as one upstream (connect timeout
1 s): ``no_breaker`` with ``failure_threshold`` = 10^9 (every request that ranks the dead URL first pays
its connect timeout before failing over: the behaviour without health tracking) and ``breaker`` with the
default threshold of 2 (the breaker opens after two connect timeouts; later requests skip the URL). The
same sequence of unique prompts (rendezvous hashing puts about half on the dead URL first) goes to each
front gateway in turn. Latency p50/p99 and the number of requests that took over 1 s. The last line
printed is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid

import aiohttp

from bench.gateway_overhead import create_tenant, percentile
from bench.upstream_stack import MODEL, PUBLIC_MODEL, upstream_stack
from tests.upstreams import blackhole

CONNECT_TIMEOUT_S = 1.0
SETTINGS = {"no_breaker": 10**9, "breaker": 2}  # failure_threshold


async def one(session: aiohttp.ClientSession, front: str, key: str, prompt: str) -> float:
    body = {"model": PUBLIC_MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    started = time.perf_counter()
    async with session.post(
        front + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as response:
        assert response.status == 200, (response.status, await response.text())
        await response.read()
    return time.perf_counter() - started


async def run(fronts: dict[str, str], num_requests: int) -> dict[str, dict[str, float]]:
    prompts = [f"[{uuid.uuid4().hex}] question {i}" for i in range(num_requests)]
    result = {}
    async with aiohttp.ClientSession() as session:
        for name, front in fronts.items():
            key = (await create_tenant(session, front, {"name": "bench"}))["api_key"]
            seconds = [await one(session, front, key, prompt) for prompt in prompts]
            ms = [s * 1000 for s in seconds]
            result[name] = {
                "p50_ms": statistics.median(ms),
                "p99_ms": percentile(ms, 99),
                "mean_ms": statistics.fmean(ms),
                "slow": sum(s >= CONNECT_TIMEOUT_S for s in seconds),
            }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60)
    args = parser.parse_args()
    started = time.monotonic()
    with (
        blackhole() as dead,
        upstream_stack(SETTINGS, log_level="ERROR", tmp_prefix="pg-bench-dead-") as stack,
    ):
        fronts = {}
        for name, threshold in SETTINGS.items():
            spec = {
                "name": "bench",
                "urls": [dead, stack.upstream + "/v1"],
                "models": {PUBLIC_MODEL: MODEL},
                "connect_timeout_s": CONNECT_TIMEOUT_S,
                "down_s": 600,
                "failure_threshold": threshold,
                "probe_interval_s": 0,  # the passive breaker alone
            }
            fronts[name] = stack.start_front(name, spec)
        result = asyncio.run(run(fronts, args.requests))
    print(f"{'front gateway':<14}{'p50':>10}{'p99':>10}{'mean':>10}{'slow (>= 1 s)':>16}")
    for name, r in result.items():
        print(
            f"{name:<14}{r['p50_ms']:>8.1f}ms{r['p99_ms']:>8.1f}ms{r['mean_ms']:>8.1f}ms"
            f"{r['slow']:>10} of {args.requests}"
        )
    print(f"(one dead URL of two, connect timeout {CONNECT_TIMEOUT_S} s, {time.monotonic() - started:.0f} s)")
    summary = {name: {k: round(v, 1) for k, v in r.items()} for name, r in result.items()}
    print(json.dumps({**summary, "requests": args.requests}))


if __name__ == "__main__":
    main()
