"""A purged or invalidated tenant leaves nothing in near-miss: no remembered prompt, vector or finding,
on the replica that took the admin call, in Redis, and on the other replicas (from their next policy
refresh)."""

from __future__ import annotations

import random

import pytest
import redis
from openai import AsyncOpenAI

from gateway.app import create_app
from gateway.state import METRICS, NEAR_MISS
from tests.gateway.conftest import ADMIN, create_tenant, make_config
from tests.gateway.test_gateway_near_miss import BLOCK, complete, embedding_cache  # noqa: F401 - fixture
from tests.gateway.test_gateway_near_miss_replicas import findings_of
from tests.gateway.test_gateway_routing_kv import three_workers, wait_until  # noqa: F401 - fixture
from tests.gateway.test_gateway_routing_redis import redis_url  # noqa: F401 - fixture


@pytest.mark.timeout(180)
@pytest.mark.parametrize("action", ["purge", "invalidate"])
async def test_a_purged_tenant_has_no_near_miss_route_or_finding_on_any_replica(
    aiohttp_client,
    sqlite_url,
    tmp_path,
    three_workers,  # noqa: F811
    redis_url,  # noqa: F811
    embedding_cache,  # noqa: F811
    action,
):
    def config(name: str):
        return make_config(
            sqlite_url,
            tmp_path / name,
            worker_urls=tuple(three_workers),
            router="rendezvous",  # the weakest exact signal: near miss is what finds the shared prefix
            kv_index=False,
            redis_url=redis_url,
            near_miss_cache_dir=str(embedding_cache),
            near_miss_max_wait_ms=10_000.0,
        )

    a = await aiohttp_client(create_app(config("a")))
    b = await aiohttp_client(create_app(config("b")))
    await a.app[NEAR_MISS].embedder.warm_up()
    await b.app[NEAR_MISS].embedder.warm_up()
    near = await create_tenant(a, name="near", near_miss_routing=True)
    kept = await create_tenant(a, name="kept", near_miss_routing=True)
    rng = random.Random(7)
    shared = [rng.randrange(1, 200) for _ in range(3 * BLOCK)]  # a per-request span at token 48

    def variant() -> list[int]:
        return shared + [rng.randrange(1, 200) for _ in range(3 * BLOCK)]

    sdks = {
        (replica, tenant["id"]): AsyncOpenAI(
            base_url=str(client.make_url("/v1")), api_key=tenant["api_key"], max_retries=0
        )
        for replica, client in (("a", a), ("b", b))
        for tenant in (near, kept)
    }
    # Both tenants send the same prompts through both replicas: each replica remembers them and
    # each tenant gets a finding (the span at token 48).
    for replica, client in (("a", a), ("b", b)):
        for tenant in (near, kept):
            remembered = client.app[NEAR_MISS].num_remembered()
            await complete(sdks[(replica, tenant["id"])], variant())
            await wait_until(lambda c=client, n=remembered: c.app[NEAR_MISS].num_remembered() == n + 1)
            await complete(sdks[(replica, tenant["id"])], variant())
    for tenant in (near, kept):
        assert [f["position_token"] for f in await findings_of(a, tenant)] == [3 * BLOCK]
    assert a.app[NEAR_MISS].num_remembered(near["id"]) >= 1
    assert b.app[NEAR_MISS].num_remembered(near["id"]) >= 1

    response = await a.post(f"/admin/v1/tenants/{near['id']}/{action}", headers=ADMIN)
    assert response.status == 200, await response.text()

    # The replica that took the call forgot at once; Redis too, so every replica lists nothing.
    assert a.app[NEAR_MISS].num_remembered(near["id"]) == 0
    assert await findings_of(a, near) == [] and await findings_of(b, near) == []
    # The other replica drops its own copy once its policy refresh sees the new epoch.
    await wait_until(lambda: b.app[NEAR_MISS].num_remembered(near["id"]) == 0)
    assert await b.app[NEAR_MISS]._findings._local.recent(near["id"]) == []
    # Another tenant keeps everything.
    assert a.app[NEAR_MISS].num_remembered(kept["id"]) >= 1
    assert b.app[NEAR_MISS].num_remembered(kept["id"]) >= 1
    assert [f["position_token"] for f in await findings_of(b, kept)] == [3 * BLOCK]

    # The purged tenant's next similar prompt finds nothing to move to, on either replica.
    registry = a.app[METRICS].registry
    for replica, client in (("a", a), ("b", b)):
        registry = client.app[METRICS].registry
        before = registry.get_sample_value("prefixgate_near_miss_routes_total", {"outcome": "moved"}) or 0.0
        usage = await complete(sdks[(replica, near["id"])], variant())
        assert usage["prefixgate"]["near_miss_tokens"] == 0
        after = registry.get_sample_value("prefixgate_near_miss_routes_total", {"outcome": "moved"}) or 0.0
        assert after == before
    for sdk in sdks.values():
        await sdk.close()


@pytest.mark.timeout(120)
async def test_deleting_a_shared_tenant_erases_its_findings_in_redis(
    aiohttp_client,
    sqlite_url,
    tmp_path,
    worker_url,
    redis_url,  # noqa: F811
    embedding_cache,  # noqa: F811
):
    """Review r17 D5: the delete of a `shared` tenant (?shared_cache=keep) left its findings, excerpts of
    its prompts, in Redis for their 7-day TTL."""
    config = make_config(
        sqlite_url,
        tmp_path,
        worker_urls=(worker_url,),
        router="rendezvous",
        kv_index=False,
        redis_url=redis_url,
        near_miss_cache_dir=str(embedding_cache),
    )
    gateway = await aiohttp_client(create_app(config))
    pooled = await create_tenant(gateway, name="pooled", isolation="shared", near_miss_routing=True)
    sdk = AsyncOpenAI(base_url=str(gateway.make_url("/v1")), api_key=pooled["api_key"], max_retries=0)
    rng = random.Random(11)
    head = [rng.randrange(1, 200) for _ in range(3 * BLOCK)]
    for _ in range(3):  # the same head, a different tail: a diverging span at token 48
        await complete(sdk, head + [rng.randrange(1, 200) for _ in range(3 * BLOCK)])
    await sdk.close()
    store = redis.Redis.from_url(redis_url)
    pattern = f"prefixgate:near-miss:{{{pooled['id']}}}:*"
    await wait_until(lambda: bool(store.keys(pattern)))
    assert await findings_of(gateway, pooled)

    response = await gateway.delete(f"/admin/v1/tenants/{pooled['id']}?shared_cache=keep", headers=ADMIN)
    assert response.status == 200, await response.text()
    # What may stay is the forget's own mark (the epoch it reached, so a late write stays out): no excerpt.
    left = [key for key in store.keys(pattern) if not key.endswith(b":forgotten-epoch")]
    store.close()
    assert left == [], "the deleted tenant's prompt excerpts stay in Redis"
