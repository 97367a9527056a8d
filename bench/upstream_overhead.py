"""Overhead of the ``openai`` external upstream path: the same chat requests sent to an OpenAI-compatible
server directly and through a prefixgate gateway that fronts it as an ``openai`` upstream.

    python -m bench.upstream_overhead [--quick]

Starts a worker (``random-tiny``), an *upstream* prefixgate gateway in front of it (the OpenAI-compatible
server; it reports ``cached_tokens``), and a *front* gateway whose only model is that server as an
``openai`` upstream (flavour ``vllm``: every request carries a server-derived ``cache_salt``), each
gateway on its own SQLite database. The front gateway's upstream key is a tenant of the upstream one.

In one run, alternating request by request with the same body (so both paths hit the same cached
prefix upstream): ``direct`` posts to the upstream with the front gateway's key; ``front`` posts to the
front gateway with a tenant key, so auth, limits, canonicalization, isolation, routing, forwarding,
response rewriting and the usage record are in the measured time. Non-streamed latency (max_tokens=1)
and streamed time to first content chunk; the added time is the paired difference (front − direct) at
p50 and p99. Then requests per second with 16 concurrent clients both ways and their ratio. The last
line printed is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

import aiohttp
from rich.progress import track

from bench.gateway_chat import CHAT_MESSAGES
from bench.gateway_overhead import create_tenant, percentile
from bench.upstream_stack import MODEL, PUBLIC_MODEL, upstream_stack


def chat_payload(model: str, stream: bool) -> bytes:
    body = {"model": model, "messages": CHAT_MESSAGES, "max_tokens": 1, "temperature": 0, "stream": stream}
    return json.dumps(body).encode()


async def timed(session: aiohttp.ClientSession, url: str, key: str, payload: bytes, stream: bool) -> float:
    """Seconds to the whole answer (non-stream) or to the first content chunk (stream)."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    started = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", data=payload, headers=headers) as response:
        assert response.status == 200, (response.status, await response.text())
        if not stream:
            await response.read()
            return time.perf_counter() - started
        elapsed = None
        async for line in response.content:
            if elapsed is None and line.startswith(b"data: {") and b'"content"' in line:
                elapsed = time.perf_counter() - started
        assert elapsed is not None
        return elapsed


async def paired(
    direct: Callable[[], Awaitable[float]], front: Callable[[], Awaitable[float]], num_pairs: int, label: str
) -> dict:
    for _ in range(5):  # warm-up: connections, caches
        await direct()
        await front()
    direct_ms, front_ms, added_ms = [], [], []
    for i in track(range(num_pairs), description=label):
        if i % 2 == 0:  # alternate the order so drift does not favour one path
            d, f = await direct(), await front()
        else:
            f, d = await front(), await direct()
        direct_ms.append(d * 1000)
        front_ms.append(f * 1000)
        added_ms.append((f - d) * 1000)
    return {
        "direct_p50_ms": statistics.median(direct_ms),
        "front_p50_ms": statistics.median(front_ms),
        "added_p50_ms": percentile(added_ms, 50),
        "added_p99_ms": percentile(added_ms, 99),
    }


async def rps(call: Callable[[], Awaitable[float]], concurrency: int, duration_s: float) -> float:
    done = 0
    deadline = time.perf_counter() + duration_s

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await call()
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done / (time.perf_counter() - started)


async def run(upstream: str, front: str, front_key: str, quick: bool) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        key = (await create_tenant(session, front, {"name": "bench"}))["api_key"]
        result = {}
        for stream in (False, True):
            direct_body, front_body = chat_payload(MODEL, stream), chat_payload(PUBLIC_MODEL, stream)

            def direct(body: bytes = direct_body, s: bool = stream) -> Awaitable[float]:
                return timed(session, upstream, front_key, body, s)

            def through(body: bytes = front_body, s: bool = stream) -> Awaitable[float]:
                return timed(session, front, key, body, s)

            name = "stream_ttft" if stream else "chat"
            result[name] = await paired(direct, through, 40 if quick else 200, name)
        direct_body, front_body = chat_payload(MODEL, False), chat_payload(PUBLIC_MODEL, False)
        duration_s = 4 if quick else 12
        result["rps_16_front"] = await rps(
            lambda: timed(session, front, key, front_body, False), 16, duration_s
        )
        result["rps_16_direct"] = await rps(
            lambda: timed(session, upstream, front_key, direct_body, False), 16, duration_s
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (about a minute)")
    args = parser.parse_args()
    started = time.monotonic()
    with upstream_stack(["front"], log_level="WARNING", tmp_prefix="pg-bench-up-") as stack:
        spec = {
            "name": "bench",
            "url": stack.upstream + "/v1",
            "models": {PUBLIC_MODEL: MODEL},
            "flavour": "vllm",
        }
        front = stack.start_front("front", spec)
        print(f"worker and gateways up after {time.monotonic() - started:.1f} s", file=sys.stderr)
        result = asyncio.run(run(stack.upstream, front, stack.front_key, args.quick))
    print(f"{'path':<14}{'direct p50':>12}{'front p50':>12}{'added p50':>11}{'added p99':>11}")
    for name in ("chat", "stream_ttft"):
        r = result[name]
        print(
            f"{name:<14}{r['direct_p50_ms']:>10.2f}ms{r['front_p50_ms']:>10.2f}ms"
            f"{r['added_p50_ms']:>9.2f}ms{r['added_p99_ms']:>9.2f}ms"
        )
    ratio = result["rps_16_front"] / result["rps_16_direct"]
    print(
        f"requests/s at 16 concurrent clients: through the front gateway {result['rps_16_front']:.1f}, "
        f"direct {result['rps_16_direct']:.1f}, front ÷ direct {ratio:.3f}"
    )
    print(f"(model {MODEL}, {'quick' if args.quick else 'full'} run, {time.monotonic() - started:.0f} s)")
    summary = {
        name: {key: round(result[name][key], 3) for key in ("added_p50_ms", "added_p99_ms")}
        for name in ("chat", "stream_ttft")
    }
    throughput = {
        "rps_16_front": round(result["rps_16_front"], 1),
        "rps_16_direct": round(result["rps_16_direct"], 1),
        "rps_ratio_front_to_direct": round(ratio, 3),
    }
    print(json.dumps({**summary, **throughput}))


if __name__ == "__main__":
    main()
