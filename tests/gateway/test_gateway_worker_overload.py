"""A worker whose bounded queue is full (503 + Retry-After, nothing started) seen through the gateway.

Real worker processes: one with one running slot and one waiting place, so a burst overflows it. Alone,
the overflow reaches the tenant as a fast 503 with Retry-After that bills nothing; with a second worker
beside it, the requests the full worker refused are served there instead.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator

import pytest

from gateway.app import create_app
from tests.gateway.conftest import ADMIN, make_config
from tests.gateway.test_gateway_faults import auth, new_tenant
from tests.worker_process import worker_process

MODEL = "random-tiny"
BURST = 6


@pytest.fixture
def full_worker(tmp_path) -> Iterator[str]:
    """A worker that runs one request and queues one more; a third is refused with 503."""
    args = ["--model", MODEL, "--num-blocks", "2048", "--max-num-seqs", "1", "--max-waiting-requests", "1"]
    with worker_process(*args, log_path=tmp_path / "full-worker.log") as url:
        yield url


def rejected_by(worker_url: str) -> float:
    with urllib.request.urlopen(f"{worker_url}/metrics", timeout=5) as response:
        text = response.read().decode()
    lines = [line for line in text.splitlines() if "rejected_overloaded" in line and not line.startswith("#")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


async def burst(client, key: str) -> list[tuple[int, dict[str, str], dict, float]]:
    async def one(i: int) -> tuple[int, dict[str, str], dict, float]:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"request {i}: " + "tell me a long story " * 8}],
            "max_tokens": 200,
            "ignore_eos": True,
        }
        started = time.monotonic()
        response = await client.post("/v1/chat/completions", json=body, headers=auth(key))
        return response.status, dict(response.headers), await response.json(), time.monotonic() - started

    return await asyncio.gather(*(one(i) for i in range(BURST)))


async def test_a_full_worker_is_a_fast_503_with_retry_after_that_bills_nothing(
    aiohttp_client, sqlite_url, tmp_path, full_worker
):
    client = await aiohttp_client(create_app(make_config(sqlite_url, tmp_path, worker_urls=(full_worker,))))
    key = await new_tenant(client)
    results = await burst(client, key)
    statuses = sorted(status for status, *_ in results)
    assert statuses.count(200) >= 2 and 503 in statuses, statuses
    for status, headers, body, elapsed_s in results:
        if status == 503:
            assert int(headers["Retry-After"]) >= 1, headers
            assert body["error"]["type"] == "service_unavailable", body
            assert elapsed_s < 10, elapsed_s  # refused at once, not after waiting for the slot
    assert rejected_by(full_worker) >= statuses.count(503)
    deadline = time.monotonic() + 20
    while True:  # usage records are written in batches
        report = await client.get("/admin/v1/reports/requests", headers=ADMIN)
        assert report.status == 200, await report.text()
        rows = (await report.json())["data"]
        if len(rows) == BURST or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    refused = [row for row in rows if row["status"] == 503]
    assert len(refused) == statuses.count(503)
    assert all(row["prompt_tokens"] == 0 and row["completion_tokens"] == 0 for row in refused), refused


async def test_requests_a_full_worker_refused_are_served_by_another(
    aiohttp_client, sqlite_url, tmp_path, full_worker, worker_url
):
    config = make_config(sqlite_url, tmp_path, worker_urls=(full_worker, worker_url), router="round_robin")
    client = await aiohttp_client(create_app(config))
    key = await new_tenant(client)
    before = rejected_by(full_worker)
    results = await burst(client, key)
    assert [status for status, *_ in results] == [200] * BURST, [json.dumps(r[2])[:200] for r in results]
    assert rejected_by(full_worker) > before  # the full worker did refuse some: they went elsewhere
