"""Faults under load: a worker killed (SIGKILL) or hung (SIGSTOP), Redis hung. No request may hang.

Real worker processes and a private redis-server; every request must end within a generous bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.app import create_app
from gateway.state import CONFIG, RATE_LIMITER, WORKER_POOL
from tests.gateway.conftest import ADMIN, make_config
from tests.worker_process import free_port, worker_process

MODEL = "random-tiny"
BOUND_S = 60  # "not hung": far above any normal answer on a loaded CI box, far below the 600 s worker timeout


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def new_tenant(client, **fields) -> str:
    response = await client.post("/admin/v1/tenants", json={"name": "t", **fields}, headers=ADMIN)
    assert response.status == 201, await response.text()
    return (await response.json())["api_key"]


async def ask(client, key: str, content: str, **extra) -> tuple[int, dict]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
    response = await client.post("/v1/chat/completions", json=body, headers=auth(key))
    if extra.get("stream") and response.status == 200:
        text = await response.text()  # an error after the first token comes inside the stream
        return (200 if '"error"' not in text else 503), {}
    return response.status, await response.json()


async def wait_for(predicate, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def pid_of_worker(port: int) -> int:
    """The pid of the ``python -m worker --port PORT`` process (Linux /proc)."""
    wanted = ["-m", "worker", "--port", str(port)]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                args = Path(f"/proc/{entry}/cmdline").read_bytes().decode().split("\0")
                if args[1:5] == wanted:
                    return int(entry)
    raise LookupError(f"no worker process on port {port}")


@pytest.fixture
def own_worker(tmp_path) -> Iterator[tuple[str, int]]:
    """A worker process this test may kill or stop: (url, pid)."""
    port = free_port()
    with worker_process(
        "--model", MODEL, "--num-blocks", "2048", port=port, log_path=tmp_path / "w.log"
    ) as url:
        pid = pid_of_worker(port)
        try:
            yield url, pid
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


async def gateway_for(aiohttp_client, sqlite_url, tmp_path, urls, **changes):
    config = make_config(sqlite_url, tmp_path, worker_urls=urls, worker_health_timeout_s=1.0, **changes)
    client = await aiohttp_client(create_app(config))
    pool = client.app[WORKER_POOL]
    await wait_for(lambda: all(state.healthy for state in pool.workers.values()))
    return client, pool


async def test_killed_worker_requests_end_fast_and_new_ones_go_elsewhere(
    aiohttp_client, sqlite_url, tmp_path, worker_url, own_worker
):
    url, pid = own_worker
    # Health checks rarely: only the retry of requests the dead worker never took can save them.
    client, pool = await gateway_for(
        aiohttp_client, sqlite_url, tmp_path, (url, worker_url), worker_health_interval_s=60
    )
    key = await new_tenant(client)
    long = [
        asyncio.create_task(
            ask(client, key, f"long {i}", max_tokens=1000, ignore_eos=True, stream=i % 2 == 0)
        )
        for i in range(6)
    ]
    await asyncio.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*long), BOUND_S)
    assert {status for status, _ in results} <= {200, 503}, results
    fresh = await asyncio.wait_for(
        asyncio.gather(*(ask(client, key, f"after {i}", max_tokens=4) for i in range(12))), BOUND_S
    )
    assert [status for status, _ in fresh] == [200] * 12, [body for status, body in fresh if status != 200]
    assert time.monotonic() - started < BOUND_S
    assert not pool.workers[url].healthy
    # Retried, failed and finished requests alike gave back what they counted (the router weighs these).
    assert [(s.in_flight, s.pending_prefill_tokens) for s in pool.workers.values()] == [(0, 0)] * 2


async def test_hung_worker_is_detected_and_its_requests_end(
    aiohttp_client, sqlite_url, tmp_path, worker_url, own_worker
):
    url, pid = own_worker
    client, pool = await gateway_for(
        aiohttp_client, sqlite_url, tmp_path, (url, worker_url), worker_health_interval_s=0.5
    )
    key = await new_tenant(client)
    long = [
        asyncio.create_task(
            ask(client, key, f"long {i}", max_tokens=1000, ignore_eos=True, stream=i % 2 == 0)
        )
        for i in range(6)
    ]
    await wait_for(lambda: pool.workers[url].in_flight > 0)
    config = client.app[CONFIG]
    # The mechanism: a probe every interval; a hung worker misses /healthz twice (the timeout each) and is
    # lost. That takes probe_s on an idle machine; the ceiling leaves room for a loaded one (load 15 took
    # over 5 s) and stays far below the requests' own timeout, which must not be what ends them.
    probe_s = config.worker_health_interval_s + 2 * config.worker_health_timeout_s
    ceiling_s = 8 * probe_s
    assert ceiling_s * 10 < config.worker_timeout_s
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    await wait_for(lambda: not pool.workers[url].healthy, timeout_s=ceiling_s)
    detected_s = time.monotonic() - stopped
    assert pool.workers[url].last_error == "no answer to /healthz in time (hung?)", detected_s
    results = await asyncio.wait_for(asyncio.gather(*long), BOUND_S)
    assert {status for status, _ in results} <= {200, 503} and 503 in {s for s, _ in results}, results
    fresh = await asyncio.wait_for(
        asyncio.gather(*(ask(client, key, f"after {i}", max_tokens=4) for i in range(8))), BOUND_S
    )
    assert [status for status, _ in fresh] == [200] * 8, fresh
    health = await (await client.get("/healthz")).json()
    assert health["workers_healthy"] == 1, (health, detected_s)
    assert [(s.in_flight, s.pending_prefill_tokens) for s in pool.workers.values()] == [(0, 0)] * 2
    os.kill(pid, signal.SIGCONT)
    await wait_for(lambda: pool.workers[url].healthy, timeout_s=10)  # back in the pool once it answers


@pytest.fixture
def own_redis(tmp_path) -> Iterator[tuple[str, subprocess.Popen]]:
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).stdout != b"PONG\n":
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


async def test_hung_redis_does_not_slow_rate_limited_requests(
    aiohttp_client, sqlite_url, tmp_path, own_redis
):
    redis_url, redis_proc = own_redis
    client = await aiohttp_client(create_app(make_config(sqlite_url, tmp_path, redis_url=redis_url)))
    key = await new_tenant(client, rate_limit_rpm=1000)
    # No worker runs here: a request the limiter lets through ends in 503 (no worker), fast.
    assert (await ask(client, key, "warm"))[0] == 503
    redis_proc.send_signal(signal.SIGSTOP)
    started = time.perf_counter()
    statuses = [(await ask(client, key, f"q{i}"))[0] for i in range(20)]
    elapsed_s = time.perf_counter() - started
    assert statuses == [503] * 20
    assert elapsed_s < 4, elapsed_s  # one short timeout, then local limits (was 0.5 s per request)
    assert client.app[RATE_LIMITER].paused
