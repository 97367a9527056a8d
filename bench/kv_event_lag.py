"""How long after a request's first token the gateway's KV-event index holds its prompt's blocks.

    python -m bench.kv_event_lag                 # 8 clients x 20 cold prompts, 3 workers

``bench.routing``'s 3 workers and in-process gateway (KV-aware); every prompt is new (8-24 random blocks,
one tenant), streamed with ``max_tokens`` 4. When a client has the first token, it waits (polling every
1 ms) until some worker's entry in the gateway's ``PrefixIndex`` holds the prompt's last full block: that
is the KV event's lag behind the first token as the client sees it (the first token also crossed the
gateway, so the lag behind the gateway's own first token is at most this plus that relay). The replay
``bench.routing_opening`` takes the lag as a parameter (``--event-lag-ms``); this measures it. Ends with
one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.gateway_overhead import percentile
from bench.routing import ADMIN, BLOCK, one, start_gateway, workers
from gateway.config import GatewayConfig
from gateway.state import PIPELINE, POLICY_CACHE, PREFIX_INDEX
from migrations import upgrade_database
from policies.hashing import block_hashes


async def main_async(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        await asyncio.to_thread(upgrade_database, GatewayConfig(data_dir=tmp).resolved_database_url)
        with workers(3, args.num_blocks, tmp) as urls:
            runner, base = await start_gateway(urls, tmp, {"router": "kv_aware", "kv_index": True})
            app = runner.app
            async with (
                aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN}"}) as admin,
                admin.post(f"{base}/admin/v1/tenants", json={"name": "lag"}) as r,
            ):
                tenant = await r.json()
            await asyncio.sleep(1)  # the policy cache and the index follow
            model = app[PIPELINE].resolve_model("random-small")
            segments = app[PIPELINE].segments(app[POLICY_CACHE].get(tenant["id"]))
            lags_ms: list[float] = []
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

                async def client(seed: int) -> None:
                    rng = random.Random(seed)
                    for _ in range(args.requests_per_client):
                        prompt = [rng.randrange(1, 250) for _ in range(BLOCK * rng.randint(8, 24))]
                        last = block_hashes(prompt, model.block_size, model.fingerprint, segments)[-1]
                        await one(session, base, tenant["api_key"], prompt)
                        got = time.perf_counter()
                        index = app[PREFIX_INDEX]
                        while not any(last in w.blocks for w in index.workers.values()):
                            if time.perf_counter() - got > 3:
                                break
                            await asyncio.sleep(0.001)
                        lags_ms.append((time.perf_counter() - got) * 1000)

                await asyncio.gather(*(client(c) for c in range(args.concurrency)))
            await runner.cleanup()
    return {
        "requests": len(lags_ms),
        "indexed_before_the_client_had_the_token": sum(lag < 0.5 for lag in lags_ms),
        "lag_p50_ms": round(percentile(lags_ms, 50), 1),
        "lag_p99_ms": round(percentile(lags_ms, 99), 1),
        "lag_max_ms": round(max(lags_ms), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests-per-client", type=int, default=20)
    parser.add_argument("--num-blocks", type=int, default=256)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
