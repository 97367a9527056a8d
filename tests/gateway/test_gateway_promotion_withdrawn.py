"""Review r22: a tenant that opted out (or was deleted) must not count towards a promotion's *hits*
either: f24 dropped it from the k tenants, but its capped hits still completed the hit threshold and
were stored in hits_per_hour. In memory and in Redis."""

import asyncio

import pytest

from gateway.app import create_app
from tests.gateway.conftest import ADMIN, create_tenant, make_config
from tests.gateway.test_gateway_canonicalization import system_with
from tests.gateway.test_gateway_promotion import ask, hot_prefixes, tenant, wait_for_hot_prefixes
from tests.gateway.test_gateway_promotion_redis import redis_url  # noqa: F401 (fixture)


@pytest.fixture(params=["memory", "redis"])
async def gateway6(request, aiohttp_client, sqlite_url, tmp_path, worker_url):
    # k = 3 tenants, 6 hits per hour: each tenant counts at most 2 hits.
    shared = request.getfixturevalue("redis_url") if request.param == "redis" else None
    config = make_config(
        sqlite_url,
        tmp_path,
        worker_urls=(worker_url,),
        promotion_min_hits=6,
        promotion_min_tenants=3,
        redis_url=shared,
    )
    return await aiohttp_client(create_app(config))


@pytest.mark.parametrize("withdrawal", ["opt_out", "delete"])
async def test_a_withdrawn_tenants_hits_do_not_complete_the_threshold(gateway6, withdrawal):
    gateway = gateway6
    system = system_with(f"the confidential plan (hits, {withdrawal})")
    victim = await create_tenant(gateway, name="victim", share_hot_prefixes=True)
    b, c, d = [await tenant(gateway, name, share_hot_prefixes=True) for name in "bcd"]
    for i in range(2):  # the victim's 2 capped hits, while opted in
        await ask(gateway, victim["api_key"], system, f"question v{i}")
    path = f"/admin/v1/tenants/{victim['id']}"
    if withdrawal == "opt_out":
        answer = await gateway.patch(path, json={"share_hot_prefixes": False}, headers=ADMIN)
    else:
        answer = await gateway.delete(path, headers=ADMIN)
    assert answer.status == 200, await answer.text()
    # The opted-in tenants send 4 hits in all: below the threshold of 6.
    await ask(gateway, b, system, "question b0")
    await ask(gateway, b, system, "question b1")
    await ask(gateway, c, system, "question c")
    await ask(gateway, d, system, "question d")
    await asyncio.sleep(1.0)  # promotions are written in the background
    rows = await hot_prefixes(gateway)
    assert rows == [], "promoted on the hits of a tenant no longer opted in"
    await ask(gateway, c, system, "question c1")
    await ask(gateway, d, system, "question d1")  # 6 live capped hits from 3 tenants: promoted
    (row,) = await wait_for_hot_prefixes(gateway, 1)
    assert (row["num_tenants"], row["hits_per_hour"]) == (3, 6)
