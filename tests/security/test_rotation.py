"""A namespace-secret rotation (review r17 D1, D3, D4): every cached block is invalidated, the shared and
promoted pools included, and purge / delete still reach what a tenant cached under an older secret."""

from gateway.app import create_app
from tests.gateway.conftest import ADMIN, create_tenant, make_config
from tests.gateway.test_gateway_purge import ask, kv_files, redis_keys, short_prompt, small_worker  # noqa: F401
from tests.security.test_deletion import fill_disk_tier, reserved_namespaces


async def rotate_and_restart(before, config):
    """Rotate the secret, then the restart the rotation asks for."""
    rotated = await before.post("/admin/v1/namespace-secret/rotate", headers=ADMIN)
    assert rotated.status == 200, await rotated.text()
    await before.close()
    return create_app(config)


async def test_delete_after_a_rotation_erases_what_the_tenant_cached_under_the_old_secret(
    aiohttp_client,
    sqlite_url,
    tmp_path,
    small_worker,  # noqa: F811 - the imported fixture
):
    url, kv_dir, redis_url = small_worker
    config = make_config(sqlite_url, tmp_path, worker_urls=(url,), namespace_salt=None)  # the DB's secret
    before = await aiohttp_client(create_app(config))
    doomed, keeper = await create_tenant(before, name="doomed"), await create_tenant(before, name="keeper")
    await fill_disk_tier(before, kv_dir, doomed, keeper)
    old_id = doomed["namespace_id"]
    after = await aiohttp_client(await rotate_and_restart(before, config))
    info = await (await after.get(f"/admin/v1/tenants/{doomed['id']}", headers=ADMIN)).json()
    assert info["namespace_id"] != old_id

    response = await after.delete(f"/admin/v1/tenants/{doomed['id']}", headers=ADMIN)
    assert response.status == 200, await response.text()
    assert kv_files(kv_dir, old_id) == [] and redis_keys(redis_url, old_id) == []
    purge = (await response.json())["purge"]
    assert purge["complete"] is True and purge["namespace_ids"] == [info["namespace_id"], old_id]
    assert purge["blocks_erased"]["l3"] > 0


async def test_delete_after_a_rotation_ends_the_reservation_of_the_old_namespace(
    aiohttp_client,
    sqlite_url,
    tmp_path,
    small_worker,  # noqa: F811 - the imported fixture
):
    url, _, _ = small_worker
    config = make_config(sqlite_url, tmp_path, worker_urls=(url,), namespace_salt=None)
    before = await aiohttp_client(create_app(config))
    tenant = await create_tenant(before, name="ded", isolation="dedicated", reserved_blocks=8)
    await ask(before, tenant["api_key"], short_prompt())
    assert tenant["namespace_id"] in await reserved_namespaces(url)
    after = await aiohttp_client(await rotate_and_restart(before, config))
    await ask(after, tenant["api_key"], short_prompt())  # reserves under the new namespace id
    response = await after.delete(f"/admin/v1/tenants/{tenant['id']}", headers=ADMIN)
    assert response.status == 200, await response.text()
    assert tenant["namespace_id"] not in await reserved_namespaces(url)
