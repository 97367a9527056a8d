"""A namespace-secret rotation (review r17 D1, D3, D4): every cached block is invalidated, the shared and
promoted pools included, and purge / delete still reach what a tenant cached under an older secret."""

from gateway.app import create_app
from tests.gateway.conftest import ADMIN, create_tenant, make_config
from tests.gateway.test_gateway_canonicalization import system_with
from tests.gateway.test_gateway_e2e import auth, cached, chat_body, unique_system_prompt
from tests.gateway.test_gateway_promotion import ask as ask_as
from tests.gateway.test_gateway_promotion import promoted_tokens, wait_for_hot_prefixes
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


async def test_a_rotation_invalidates_the_shared_pool(aiohttp_client, sqlite_url, tmp_path, worker_url):
    config = make_config(sqlite_url, tmp_path, worker_urls=(worker_url,), namespace_salt=None)
    before = await aiohttp_client(create_app(config))
    key = (await create_tenant(before, name="pooled", isolation="shared"))["api_key"]
    body = chat_body(unique_system_prompt())
    for _ in range(2):
        first = await (await before.post("/v1/chat/completions", json=body, headers=auth(key))).json()
    assert cached(first) > 0  # cached in the global pool
    after = await aiohttp_client(await rotate_and_restart(before, config))
    again = await (await after.post("/v1/chat/completions", json=body, headers=auth(key))).json()
    assert cached(again) == 0, "a block of the shared pool cached before the rotation was reused after it"


async def test_a_rotation_invalidates_promoted_kv_but_keeps_the_promotions(
    aiohttp_client, sqlite_url, tmp_path, worker_url
):
    config = make_config(
        sqlite_url,
        tmp_path,
        worker_urls=(worker_url,),
        namespace_salt=None,
        promotion_min_hits=3,
        promotion_min_tenants=3,
    )
    before = await aiohttp_client(create_app(config))
    system = system_with("the rotation drill")
    keys = [(await create_tenant(before, name=n, share_hot_prefixes=True))["api_key"] for n in "abc"]
    for key in keys:
        await ask_as(before, key, system, f"question {key[-4:]}")
    [row] = await wait_for_hot_prefixes(before, 1)
    await ask_as(before, keys[1], system, "makes the promoted copy")
    warm = await ask_as(before, keys[0], system, "warm")
    assert promoted_tokens(warm) > 0 and cached(warm) >= promoted_tokens(warm)  # the promoted copy serves

    after = await aiohttp_client(await rotate_and_restart(before, config))
    assert [r["id"] for r in await wait_for_hot_prefixes(after, 1)] == [row["id"]]  # the promotion stays
    cold = await ask_as(after, keys[1], system, "cold")
    assert cached(cold) == 0, "promoted KV cached before the rotation was reused after it"
    again = await ask_as(after, keys[2], system, "again")  # another tenant: only the promoted pool serves it
    assert cached(again) >= row["num_tokens"]  # the promotion is still applied, under the new secret
