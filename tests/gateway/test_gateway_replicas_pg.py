"""Two gateway replicas on one PostgreSQL: an admin change on one reaches the other within 2 s."""

import asyncio
import time

from gateway.app import create_app
from tests.gateway.conftest import ADMIN, make_config

PROPAGATION_LIMIT_S = 2.0


async def wait_for_status(client, key: str, status: int) -> float:
    started = time.monotonic()
    while time.monotonic() - started < PROPAGATION_LIMIT_S:
        response = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        if response.status == status:
            return time.monotonic() - started
        await asyncio.sleep(0.05)
    raise AssertionError(f"replica did not answer {status} within {PROPAGATION_LIMIT_S}s")


async def test_admin_changes_reach_every_replica(aiohttp_client, pg_url, tmp_path, worker_url):
    # Production-like refresh interval (the default), not the tests' fast one. A real worker: deleting
    # a tenant purges its KV first.
    workers = (worker_url,)
    a = await aiohttp_client(
        create_app(make_config(pg_url, tmp_path / "a", policy_refresh_s=0.5, worker_urls=workers))
    )
    b = await aiohttp_client(
        create_app(make_config(pg_url, tmp_path / "b", policy_refresh_s=0.5, worker_urls=workers))
    )

    created = await (await a.post("/admin/v1/tenants", json={"name": "acme"}, headers=ADMIN)).json()
    await wait_for_status(b, created["api_key"], 200)

    rotated = await (await a.post(f"/admin/v1/tenants/{created['id']}/keys/rotate", headers=ADMIN)).json()
    await wait_for_status(b, created["api_key"], 401)
    await wait_for_status(b, rotated["api_key"], 200)

    await a.patch(f"/admin/v1/tenants/{created['id']}", json={"isolation": "dedicated"}, headers=ADMIN)
    from gateway.state import POLICY_CACHE

    started = time.monotonic()
    while b.app[POLICY_CACHE].get(created["id"]).isolation != "dedicated":
        assert time.monotonic() - started < PROPAGATION_LIMIT_S
        await asyncio.sleep(0.05)

    await a.post(f"/admin/v1/tenants/{created['id']}/invalidate", headers=ADMIN)
    started = time.monotonic()
    while b.app[POLICY_CACHE].get(created["id"]).epoch != 1:
        assert time.monotonic() - started < PROPAGATION_LIMIT_S
        await asyncio.sleep(0.05)

    assert (await b.delete(f"/admin/v1/tenants/{created['id']}", headers=ADMIN)).status == 200
    await wait_for_status(a, rotated["api_key"], 401)
