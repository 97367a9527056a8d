"""Deletions that do what they say (issue 11): purge, invalidate and delete for every isolation level."""

import asyncio
import time

from gateway.app import create_app
from tests.gateway.conftest import ADMIN, create_tenant, make_config
from tests.gateway.test_gateway_purge import (  # noqa: F401 - small_worker is a fixture
    ask,
    kv_files,
    redis_keys,
    short_prompt,
    small_worker,
)


async def fill_disk_tier(gateway, kv_dir, tenant: dict, other: dict) -> None:
    for _ in range(3):
        await ask(gateway, tenant["api_key"], short_prompt())
    deadline = time.monotonic() + 20
    while not kv_files(kv_dir, tenant["namespace_id"]):
        assert time.monotonic() < deadline, "blocks never reached the disk tier"
        await ask(gateway, other["api_key"], short_prompt())  # push older blocks down the tiers
        await asyncio.sleep(0.05)


async def test_deleting_a_tenant_erases_its_kv_in_every_tier_first(
    aiohttp_client,
    sqlite_url,
    tmp_path,
    small_worker,  # noqa: F811 - the imported fixture
):
    url, kv_dir, redis_url = small_worker
    gateway = await aiohttp_client(create_app(make_config(sqlite_url, tmp_path, worker_urls=(url,))))
    doomed, keeper = await create_tenant(gateway, name="doomed"), await create_tenant(gateway, name="keeper")
    await fill_disk_tier(gateway, kv_dir, doomed, keeper)

    response = await gateway.delete(f"/admin/v1/tenants/{doomed['id']}", headers=ADMIN)
    assert response.status == 200, await response.text()
    body = await response.json()
    assert body["deleted"] is True and body["purge"]["complete"] is True
    assert body["purge"]["blocks_erased"]["l3"] > 0
    assert not any(kv_dir.glob(f"*/{doomed['namespace_id']}/*"))  # its prompts are not on disk any more
    assert redis_keys(redis_url, doomed["namespace_id"]) == []
    assert (await gateway.get(f"/admin/v1/tenants/{doomed['id']}", headers=ADMIN)).status == 404


async def test_deleting_with_a_worker_down_keeps_the_tenant_so_the_purge_can_be_retried(client):
    tenant = await create_tenant(client)  # the config's only worker URL has nobody listening
    response = await client.delete(f"/admin/v1/tenants/{tenant['id']}", headers=ADMIN)
    assert response.status == 502, await response.text()
    assert (await response.json())["error"]["code"] == "purge_incomplete"
    assert (await client.get(f"/admin/v1/tenants/{tenant['id']}", headers=ADMIN)).status == 200


async def test_purge_and_invalidate_of_a_shared_tenant_are_an_honest_409(client):
    tenant = await create_tenant(client, isolation="shared")
    for action in ("purge", "invalidate"):
        response = await client.post(f"/admin/v1/tenants/{tenant['id']}/{action}", headers=ADMIN)
        assert response.status == 409, (action, await response.text())
        error = (await response.json())["error"]
        assert error["code"] == "shared_cache" and "common pool" in error["message"]
    delete = await client.delete(f"/admin/v1/tenants/{tenant['id']}", headers=ADMIN)
    assert delete.status == 409
    kept = await client.delete(f"/admin/v1/tenants/{tenant['id']}?shared_cache=keep", headers=ADMIN)
    assert kept.status == 200 and (await kept.json())["purge"] is None
