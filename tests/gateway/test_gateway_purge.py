"""Invalidation end to end: tenant purge (disk files and Redis entries gone), partial purges, and a new
model fingerprint behind the same gateway reusing nothing."""

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.app import create_app
from gateway.state import WORKER_POOL
from tests.gateway.conftest import ADMIN, ADMIN_TOKEN, create_tenant, make_config
from tests.gateway.test_gateway_admin_api import run_cli
from tests.gateway.test_gateway_e2e import MODEL, auth, cached, chat_body
from tests.tenancy.db_support import REDIS_ENV
from tests.worker_process import free_port, worker_process


def short_prompt() -> str:
    """About 300 tokens, unique."""
    return f"[{uuid.uuid4()}] " + " ".join(f"fact-{i}" for i in range(45))


async def ask(gateway, key: str, system: str) -> dict:
    response = await gateway.post("/v1/chat/completions", json=chat_body(system), headers=auth(key))
    assert response.status == 200, await response.text()
    return await response.json()


def kv_files(kv_dir: Path, namespace_id: str) -> list[Path]:
    return list(kv_dir.glob(f"*/{namespace_id}/*.kv"))


def redis_keys(url: str | None, namespace_id: str) -> list[bytes]:
    if url is None:
        return []
    import redis

    client = redis.Redis.from_url(url)
    try:
        return list(client.scan_iter(match=f"pg:kv:*:{namespace_id}:*"))
    finally:
        client.close()


@pytest.fixture
def small_worker(tmp_path):
    """A worker with a small L1 and L2 so blocks reach its disk tier (and Redis, when configured)."""
    kv_dir = tmp_path / "worker" / "kv"
    redis_url = os.environ.get(REDIS_ENV)
    args = ["--model", "random-tiny", "--num-blocks", "40", "--max-model-len", "512", "--l2-bytes", "16384"]
    args += ["--data-dir", str(tmp_path / "worker"), "--l3-min-free-bytes", "0"]
    if redis_url:
        args += ["--remote-url", redis_url, "--remote-ttl-s", "300"]
    with worker_process(*args, log_path=tmp_path / "worker.log") as url:
        yield url, kv_dir, redis_url


async def test_purge_erases_the_tenant_from_disk_and_redis(
    aiohttp_client, sqlite_url, tmp_path, small_worker
):
    url, kv_dir, redis_url = small_worker
    gateway = await aiohttp_client(create_app(make_config(sqlite_url, tmp_path, worker_urls=(url,))))
    doomed = await create_tenant(gateway, name="doomed")
    keeper = await create_tenant(gateway, name="keeper")
    prompts = [short_prompt() for _ in range(3)]
    for prompt in prompts:
        await ask(gateway, doomed["api_key"], prompt)
    await ask(gateway, keeper["api_key"], short_prompt())
    deadline = time.monotonic() + 20
    while not (kv_files(kv_dir, doomed["namespace_id"]) and kv_files(kv_dir, keeper["namespace_id"])):
        assert time.monotonic() < deadline, "blocks never reached the disk tier"
        await ask(gateway, keeper["api_key"], short_prompt())  # push older blocks down the tiers
        await asyncio.sleep(0.05)
    assert bool(redis_keys(redis_url, doomed["namespace_id"])) == bool(redis_url)

    response = await gateway.post(f"/admin/v1/tenants/{doomed['id']}/purge", headers=ADMIN)
    assert response.status == 200, await response.text()
    result = await response.json()
    assert result["complete"] is True and result["epoch"] == 1
    assert result["namespace_id"] == doomed["namespace_id"]
    assert set(result["blocks_erased"]) == {"l1", "l2", "l3", "remote"}
    assert result["blocks_erased"]["l3"] > 0 and (result["blocks_erased"]["remote"] > 0) == bool(redis_url)
    assert result["total_blocks_erased"] == sum(result["blocks_erased"].values())
    assert [w["ok"] for w in result["workers"]] == [True]

    assert kv_files(kv_dir, doomed["namespace_id"]) == []
    assert not any(kv_dir.glob(f"*/{doomed['namespace_id']}/*"))  # no file of it at all, .tmp included
    assert redis_keys(redis_url, doomed["namespace_id"]) == []
    assert kv_files(kv_dir, keeper["namespace_id"])  # other tenants keep theirs
    assert cached(await ask(gateway, doomed["api_key"], prompts[0])) == 0

    audit = await (
        await gateway.get("/admin/v1/audit", params={"tenant_id": doomed["id"]}, headers=ADMIN)
    ).json()
    purge = next(row for row in audit["data"] if row["action"] == "tenant.purge")
    assert purge["details"]["blocks_erased"] == result["blocks_erased"]
    assert purge["details"]["workers_failed"] == []
    metrics = await (await gateway.get("/metrics", headers=ADMIN)).text()
    assert 'prefixgate_purges_total{outcome="complete"} 1.0' in metrics


async def test_purge_with_an_unreachable_worker_is_a_502_with_details(
    aiohttp_client, sqlite_url, tmp_path, worker_url, capsys, monkeypatch
):
    dead = f"http://127.0.0.1:{free_port()}"
    gateway = await aiohttp_client(
        create_app(make_config(sqlite_url, tmp_path, worker_urls=(worker_url, dead)))
    )
    created = await create_tenant(gateway, name="partial")
    await ask(gateway, created["api_key"], short_prompt())

    response = await gateway.post(f"/admin/v1/tenants/{created['id']}/purge", headers=ADMIN)
    assert response.status == 502
    body = await response.json()
    assert body["complete"] is False and body["error"]["code"] == "purge_incomplete"
    assert body["error"]["type"] == "upstream_error" and dead in body["error"]["message"]
    by_url = {w["url"]: w for w in body["workers"]}
    assert by_url[worker_url]["ok"] is True and by_url[worker_url]["blocks_erased"]["l1"] > 0
    assert by_url[dead]["ok"] is False and by_url[dead]["blocks_erased"] is None and by_url[dead]["error"]
    assert body["blocks_erased"]["l1"] == by_url[worker_url]["blocks_erased"]["l1"]
    assert body["epoch"] == 1  # what the dead worker holds can never be reused

    missing = await gateway.post("/admin/v1/tenants/tn_nope/purge", headers=ADMIN)
    assert missing.status == 404

    monkeypatch.setenv("PREFIXGATE_URL", str(gateway.make_url("")))
    monkeypatch.setenv("PREFIXGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    code, out, err = await run_cli(capsys, "tenant", "purge", "partial")
    assert code == 1 and "purge incomplete" in err
    assert json.loads(out)["workers"][1]["ok"] is False
    code, out, _ = await run_cli(capsys, "hot-prefixes", "list", "--all")
    assert code == 0 and json.loads(out)["data"] == []
    code, _, err = await run_cli(capsys, "hot-prefixes", "show", "hp_nope")
    assert code == 1 and "not found" in err


@contextlib.contextmanager
def worker_on(port: int, data_dir: Path, *extra: str) -> Iterator[None]:
    """A worker on a fixed port (the gateway's configured URL), stopped cleanly (it flushes to disk)."""
    args = [
        "--model",
        "random-tiny",
        "--num-blocks",
        "256",
        "--max-model-len",
        "1024",
        "--data-dir",
        str(data_dir),
    ]
    log = data_dir.parent / f"worker-{time.monotonic_ns()}.log"
    with worker_process(*args, *extra, log_path=log, port=port):
        yield


async def wait_for_worker(gateway, url: str, previous_id: str | None) -> str:
    """Until the gateway has seen the (re)started worker come up and re-read its /v1/info."""
    state = gateway.app[WORKER_POOL].workers[url]
    deadline = time.monotonic() + 20
    while not (state.healthy and state.worker_id and state.worker_id != previous_id):
        assert time.monotonic() < deadline, state.last_error
        await asyncio.sleep(0.05)
    return state.worker_id


async def test_new_model_fingerprint_reuses_nothing(aiohttp_client, sqlite_url, tmp_path):
    port = free_port()
    url, data_dir = f"http://127.0.0.1:{port}", tmp_path / "worker"
    gateway = await aiohttp_client(create_app(make_config(sqlite_url, tmp_path, worker_urls=(url,))))
    key = (await create_tenant(gateway, name="fp"))["api_key"]
    prompt = short_prompt()
    pool = gateway.app[WORKER_POOL]

    with worker_on(port, data_dir):
        worker_id = await wait_for_worker(gateway, url, None)
        await ask(gateway, key, prompt)
        assert cached(await ask(gateway, key, prompt)) > 0
        fingerprint = pool.model(MODEL).fingerprint

    # Control: the same weights after a restart reuse the prefix from disk.
    with worker_on(port, data_dir):
        worker_id = await wait_for_worker(gateway, url, worker_id)
        again = await ask(gateway, key, prompt)
        assert cached(again) > 0 and again["usage"]["prefixgate"]["cached_tokens_by_tier"]["l3"] > 0

    # Another KV dtype is another model fingerprint: every block hash changes, nothing is reused.
    with worker_on(port, data_dir, "--dtype", "bfloat16"):
        await wait_for_worker(gateway, url, worker_id)
        assert pool.model(MODEL).fingerprint != fingerprint
        after = await ask(gateway, key, prompt)
        assert cached(after) == 0
        assert after["system_fingerprint"] != again["system_fingerprint"]
        assert cached(await ask(gateway, key, prompt)) > 0  # the new model caches as usual
