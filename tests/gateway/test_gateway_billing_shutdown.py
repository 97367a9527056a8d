"""``docker stop`` on the real gateway process (``python -m gateway gateway``): SIGTERM with streams in
flight, SIGKILL if it is still alive after the container's grace period. The gateway drains within its
own (shorter) grace, cuts the rest, and flushes usage before it exits: every stream that delivered
something has exactly one record with the tokens it delivered."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import yaml
from sqlalchemy import select

from gateway.up import free_port
from migrations import upgrade_database_async
from tenancy.db import create_engine, create_sessionmaker
from tenancy.models import UsageRecord
from tenancy.repository import TenantRepository
from tests.gateway.test_gateway_billing import parse_sse, streamed_text
from tests.gateway.test_gateway_e2e import chat_body, unique_system_prompt

GRACE_S = 2.0  # the gateway's drain
CONTAINER_GRACE_S = 10.0  # docker stop's wait before SIGKILL (compose: 30 s for 20 s of drain)
NUM_LONG, NUM_SHORT = 8, 3


async def _tenant_key(url: str) -> str:
    engine = create_engine(url)
    _, new_key = await TenantRepository(create_sessionmaker(engine)).create_tenant({"name": "stopper"})
    await engine.dispose()
    return new_key.api_key


async def _records(url: str) -> dict[str, UsageRecord]:
    engine = create_engine(url)
    async with create_sessionmaker(engine)() as session:
        rows = list(await session.scalars(select(UsageRecord)))
    await engine.dispose()
    assert len(rows) == len({row.request_id for row in rows}), "duplicate usage records"
    return {row.request_id: row for row in rows}


async def _stream(
    session: aiohttp.ClientSession, base: str, key: str, max_tokens: int, started: list
) -> tuple[str, bytes]:
    """The stream's x-request-id (its usage record's key) and what arrived of it."""
    body = chat_body(unique_system_prompt(), stream=True, max_tokens=max_tokens, ignore_eos=True)
    async with session.post(
        f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as response:
        assert response.status == 200
        raw = b""
        try:
            async for chunk in response.content.iter_any():
                if not raw:
                    started.append(1)
                raw += chunk
        except aiohttp.ClientPayloadError:
            pass  # the server closed the connection at the end of its drain
        return response.headers["x-request-id"], raw


def _wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "gateway exited at start"
        try:
            with urllib.request.urlopen(f"{base}/healthz", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError("gateway did not become healthy")


async def test_docker_stop_drains_cuts_and_records_every_stream(tmp_path: Path, worker_url: str):
    url = f"sqlite+aiosqlite:///{tmp_path / 'prefixgate.db'}"
    await upgrade_database_async(url)
    key = await _tenant_key(url)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "PREFIXGATE_HOST": "127.0.0.1",
        "PREFIXGATE_PORT": str(port),
        "PREFIXGATE_DATA_DIR": str(tmp_path / "data"),
        "PREFIXGATE_DATABASE_URL": url,
        "PREFIXGATE_WORKER_URLS": worker_url,
        "PREFIXGATE_ADMIN_TOKEN": "admin",
        "PREFIXGATE_NAMESPACE_SALT": "salt",
        "PREFIXGATE_SHUTDOWN_GRACE_S": str(GRACE_S),
        "PREFIXGATE_USAGE_FLUSH_S": "3600",  # every record still in memory at SIGTERM
        "PREFIXGATE_POLICY_REFRESH_S": "0.2",
    }
    log = open(tmp_path / "gateway.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "gateway"], env=env, stdout=log, stderr=log)
    try:
        await asyncio.to_thread(_wait_healthy, base, proc)
        started: list = []
        async with aiohttp.ClientSession() as session:
            short = [asyncio.create_task(_stream(session, base, key, 5, [])) for _ in range(NUM_SHORT)]
            long = [asyncio.create_task(_stream(session, base, key, 3500, started)) for _ in range(NUM_LONG)]
            await asyncio.gather(*short)
            while len(started) < NUM_LONG:
                await asyncio.sleep(0.02)
            stop_at = time.monotonic()
            proc.send_signal(signal.SIGTERM)  # docker stop
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), CONTAINER_GRACE_S)
            except TimeoutError:
                proc.kill()  # what docker does next
                raise AssertionError("the gateway outlived the container's grace period") from None
            stopped_in_s = time.monotonic() - stop_at
            cut = await asyncio.gather(*long)
            completed = [t.result() for t in short]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert proc.returncode == 0, (tmp_path / "gateway.log").read_text()[-3000:]
    assert GRACE_S <= stopped_in_s < CONTAINER_GRACE_S

    rows = await _records(url)
    assert len(rows) == NUM_LONG + NUM_SHORT
    for request_id, raw in completed:
        events = parse_sse(raw)
        row = rows[request_id]
        assert row.outcome == "completed" and row.completion_tokens == 5
    for request_id, raw in cut:
        events = parse_sse(raw)
        text = streamed_text(events)
        row = rows[request_id]
        assert row.outcome == "shutdown" and row.status == 200
        assert 0 < len(text) <= row.completion_tokens <= len(text.encode()) < 3500
        assert row.prompt_tokens > 64 and row.cost_total > 0


def test_compose_gives_the_gateway_more_time_than_its_drain_and_flush():
    compose = yaml.safe_load((Path(__file__).parents[2] / "docker" / "compose.yaml").read_text())
    gateway = compose["services"]["gateway"]
    container_s = float(gateway["stop_grace_period"].removesuffix("s"))
    grace_s = float(gateway["environment"]["PREFIXGATE_SHUTDOWN_GRACE_S"])
    flush_s = float(gateway["environment"]["PREFIXGATE_USAGE_DB_TIMEOUT_S"])
    assert grace_s + flush_s + 5 <= container_s
