"""A deleted tenant's metric series leave /metrics on every replica (review r15 #5): else /metrics grows
with every tenant ever created."""

from __future__ import annotations

import asyncio

from gateway.app import create_app
from tests.gateway.conftest import ADMIN, make_config


async def _call(client, key: str) -> None:
    """One tenant call (model "m" is served nowhere: an error), counted under the tenant's label."""
    headers = {"Authorization": f"Bearer {key}"}
    await client.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers=headers)


async def _series_of(client, tenant_id: str) -> list[str]:
    text = await (await client.get("/metrics", headers=ADMIN)).text()
    return [line for line in text.splitlines() if f'tenant="{tenant_id}"' in line]


async def _until(predicate, *args, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not await predicate(*args):
            await asyncio.sleep(0.05)


async def test_a_deleted_tenants_series_leave_every_replica(aiohttp_client, sqlite_url, tmp_path, worker_url):
    config = {"worker_urls": (worker_url,)}  # the delete purges the tenant's own namespaces on the worker
    replicas = [
        await aiohttp_client(create_app(make_config(sqlite_url, tmp_path / name, **config)))
        for name in ("a", "b")
    ]
    a, b = replicas
    tenants = []
    for name in ("gone", "kept"):
        body = {"name": name, "isolation": "shared"}
        tenants.append(await (await a.post("/admin/v1/tenants", json=body, headers=ADMIN)).json())
    gone, kept = tenants
    for replica in replicas:
        for tenant in tenants:
            await _until(_known, replica, tenant["api_key"])  # b loads the new tenants by polling
            await _call(replica, tenant["api_key"])
        assert await _series_of(replica, gone["id"]) and await _series_of(replica, kept["id"])

    response = await a.delete(f"/admin/v1/tenants/{gone['id']}?shared_cache=keep", headers=ADMIN)
    assert response.status == 200
    assert await _series_of(a, gone["id"]) == []  # the replica that deleted it: at once
    await _until(_no_series, b, gone["id"])  # the other one: at its next reload
    for replica in replicas:
        assert any("prefixgate_requests_total" in line for line in await _series_of(replica, kept["id"]))


async def _known(client, key: str) -> bool:
    response = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    return response.status == 200


async def _no_series(client, tenant_id: str) -> bool:
    return not await _series_of(client, tenant_id)
