"""Deletions that do what they say (issue 11): purge, invalidate and delete for every isolation level."""

import asyncio
import time

import aiohttp
import pytest

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


async def test_invalidate_and_plain_delete_of_a_shared_tenant_are_an_honest_409(client):
    tenant = await create_tenant(client, isolation="shared")
    response = await client.post(f"/admin/v1/tenants/{tenant['id']}/invalidate", headers=ADMIN)
    assert response.status == 409, await response.text()
    error = (await response.json())["error"]
    assert error["code"] == "shared_cache" and "common pool" in error["message"]
    delete = await client.delete(f"/admin/v1/tenants/{tenant['id']}", headers=ADMIN)
    assert delete.status == 409 and (await delete.json())["error"]["code"] == "shared_cache"


@pytest.mark.parametrize("action", ["purge", "delete"])
async def test_a_tenant_moved_to_shared_still_has_its_private_namespace_erased(
    aiohttp_client,
    sqlite_url,
    tmp_path,
    small_worker,  # noqa: F811 - the imported fixture
    action,
):
    """Review r17 D2: what it cached under `namespace` isolation is its own, whatever its level now (the
    purge answered 409 and the delete with ?shared_cache=keep left every t-… file and Redis key)."""
    url, kv_dir, redis_url = small_worker
    gateway = await aiohttp_client(create_app(make_config(sqlite_url, tmp_path, worker_urls=(url,))))
    doomed, keeper = await create_tenant(gateway, name="doomed"), await create_tenant(gateway, name="keeper")
    await fill_disk_tier(gateway, kv_dir, doomed, keeper)
    moved = await gateway.patch(
        f"/admin/v1/tenants/{doomed['id']}", json={"isolation": "shared"}, headers=ADMIN
    )
    assert moved.status == 200, await moved.text()

    if action == "purge":
        response = await gateway.post(f"/admin/v1/tenants/{doomed['id']}/purge", headers=ADMIN)
    else:
        response = await gateway.delete(f"/admin/v1/tenants/{doomed['id']}?shared_cache=keep", headers=ADMIN)
    assert response.status == 200, await response.text()
    body = await response.json()
    purge = body if action == "purge" else body["purge"]
    assert purge["complete"] is True and purge["blocks_erased"]["l3"] > 0
    assert body.get("shared_pool_erased", False) is False  # the common pool is never touched
    assert kv_files(kv_dir, doomed["namespace_id"]) == []
    assert redis_keys(redis_url, doomed["namespace_id"]) == []


async def reserved_namespaces(url: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/stats") as response:
        return (await response.json())["reserved_blocks"]


async def test_deleting_a_tenant_moved_off_dedicated_ends_its_reservation(
    aiohttp_client,
    sqlite_url,
    tmp_path,
    small_worker,  # noqa: F811 - the imported fixture
):
    """Review r17 D3: the worker kept granting reserved blocks to the deleted tenant's namespace id."""
    url, _, _ = small_worker
    gateway = await aiohttp_client(create_app(make_config(sqlite_url, tmp_path, worker_urls=(url,))))
    doomed = await create_tenant(gateway, name="doomed", isolation="dedicated", reserved_blocks=8)
    await ask(gateway, doomed["api_key"], short_prompt())
    assert (await reserved_namespaces(url)).get(doomed["namespace_id"], 0) > 0
    moved = await gateway.patch(
        f"/admin/v1/tenants/{doomed['id']}", json={"isolation": "shared"}, headers=ADMIN
    )
    assert moved.status == 200, await moved.text()
    await ask(gateway, doomed["api_key"], short_prompt())  # its requests now carry the global namespace
    response = await gateway.delete(f"/admin/v1/tenants/{doomed['id']}?shared_cache=keep", headers=ADMIN)
    assert response.status == 200, await response.text()
    assert doomed["namespace_id"] not in await reserved_namespaces(url)
