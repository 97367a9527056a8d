"""Near-miss findings are shared by gateway replicas through Redis, bounded per tenant, never crossed."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
import uuid

import pytest
import redis.asyncio as redis
from openai import AsyncOpenAI

from gateway.app import create_app
from gateway.near_miss_findings import DivergingSpan, RedisFindings
from gateway.state import NEAR_MISS, POLICY_CACHE
from tests.gateway.conftest import ADMIN, create_tenant, make_config
from tests.gateway.test_gateway_near_miss import BLOCK, complete, embedding_cache  # noqa: F401 - fixture
from tests.gateway.test_gateway_routing_kv import wait_until
from tests.gateway.test_gateway_routing_redis import redis_url  # noqa: F401 - fixture


def span(position: int, seen_at: float) -> DivergingSpan:
    return DivergingSpan(
        model_id="m",
        position_token=position,
        before_text="shared",
        request_text="ours",
        other_text="theirs",
        tokens_after=10,
        seen_at=seen_at,
    )


async def test_redis_findings_keep_the_newest_per_tenant_once_per_position(redis_url):  # noqa: F811
    store = RedisFindings(redis_url, salt=b"s", limit=3, key_prefix=f"test-nm-{uuid.uuid4().hex}")
    reader = RedisFindings(redis_url, salt=b"s", limit=3, key_prefix=store._prefix)  # another replica
    now = time.time()
    for i, position in enumerate((16, 32, 48, 32, 64, 80)):  # 32 again: already known, not re-added
        await store.record("tenant-a", span(position, now + i))
    assert [f["position_token"] for f in await reader.recent("tenant-a")] == [80, 64, 48]
    assert await reader.recent("tenant-b") == []
    await reader.forget("tenant-a")
    assert await store.recent("tenant-a") == []
    await store.close()
    await reader.close()


async def test_redis_outage_keeps_this_replicas_findings():
    store = RedisFindings("redis://127.0.0.1:1/0", salt=b"s", timeout_s=0.2)  # nothing listens there
    await store.record("tenant-a", span(16, time.time()))  # does not raise
    assert [f["position_token"] for f in await store.recent("tenant-a")] == [16]
    await store.close()


async def findings_of(client, tenant: dict) -> list[dict]:
    response = await client.get(f"/admin/v1/tenants/{tenant['id']}/near-miss", headers=ADMIN)
    assert response.status == 200
    return (await response.json())["data"]


@pytest.mark.timeout(120)
async def test_a_near_miss_seen_by_one_replica_is_listed_by_the_other(
    aiohttp_client,
    sqlite_url,
    tmp_path,
    worker_url,
    redis_url,  # noqa: F811
    embedding_cache,  # noqa: F811
):
    def config(name: str):
        return make_config(
            sqlite_url,
            tmp_path / name,
            worker_urls=(worker_url,),
            router="rendezvous",
            kv_index=False,
            redis_url=redis_url,
            near_miss_cache_dir=str(embedding_cache),
            near_miss_max_wait_ms=10_000.0,
        )

    a = await aiohttp_client(create_app(config("a")))
    b = await aiohttp_client(create_app(config("b")))
    await a.app[NEAR_MISS].embedder.warm_up()
    near = await create_tenant(a, name="near", near_miss_routing=True)
    other = await create_tenant(a, name="other", near_miss_routing=True)
    sdk = AsyncOpenAI(base_url=str(a.make_url("/v1")), api_key=near["api_key"], max_retries=0)
    rng = random.Random(5)
    shared = [rng.randrange(1, 200) for _ in range(3 * BLOCK)]
    await complete(sdk, shared + [rng.randrange(1, 200) for _ in range(3 * BLOCK)])
    await wait_until(lambda: a.app[NEAR_MISS].num_remembered() == 1)
    await complete(sdk, shared + [rng.randrange(1, 200) for _ in range(3 * BLOCK)])  # parts at token 48

    deadline = time.monotonic() + 10
    while not (listed := await findings_of(b, near)):
        assert time.monotonic() < deadline, "replica b never listed the finding"
        await asyncio.sleep(0.05)
    assert listed[0]["position_token"] == 3 * BLOCK
    assert b.app[NEAR_MISS].num_remembered() == 0  # b saw no request: the finding came through Redis
    assert await findings_of(a, near) == listed
    # b learns of the tenant from its next policy reload (every 0.1 s here): not a race the test measures
    await wait_until(lambda: b.app[POLICY_CACHE].authenticate(near["api_key"]) is not None)
    lint = await b.post(
        "/v1/prompt-lint",
        json={"model": "random-tiny", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {near['api_key']}"},
    )
    body = await lint.json()
    assert lint.status == 200, body
    assert body["near_miss_findings"] == listed
    assert await findings_of(b, other) == [] and await findings_of(a, other) == []  # never another's
    await sdk.close()


async def test_a_namespace_secret_rotation_leaves_the_old_findings_behind(
    aiohttp_client,
    sqlite_url,
    tmp_path,
    redis_url,  # noqa: F811
):
    """Every namespace changes with the secret: findings recorded under the old one (kept in Redis) are
    no longer listed by a replica restarted on the new one; the same replica setup before the rotation
    still lists them (a restart alone forgets nothing). Invalidating the tenant afterwards still erases
    them from Redis (they hold prompt text)."""

    async def replica(name: str):  # the secret from the database (no configured namespace_salt)
        config = make_config(sqlite_url, tmp_path / name, namespace_salt="", redis_url=redis_url)
        return await aiohttp_client(create_app(config))

    first = await replica("a")
    tenant = await create_tenant(first, near_miss_routing=True)
    marker = f"text-{uuid.uuid4().hex}"
    await first.app[NEAR_MISS]._findings.record(
        tenant["id"], dataclasses.replace(span(16, 1.0), before_text=marker)
    )
    assert [f["position_token"] for f in await findings_of(first, tenant)] == [16]
    await first.close()
    restarted = await replica("b")
    assert [f["position_token"] for f in await findings_of(restarted, tenant)] == [16]
    rotated = await restarted.post("/admin/v1/namespace-secret/rotate", headers=ADMIN)
    assert rotated.status == 200
    await restarted.close()
    on_new_secret = await replica("c")
    assert await findings_of(on_new_secret, tenant) == []
    response = await on_new_secret.post(f"/admin/v1/tenants/{tenant['id']}/invalidate", headers=ADMIN)
    assert response.status == 200, await response.text()
    store = redis.from_url(redis_url)
    try:
        kept = [
            value
            async for key in store.scan_iter(match="prefixgate:near-miss:*", _type="hash")
            for value in await store.hvals(key)
        ]
    finally:
        await store.aclose()
    assert not [value for value in kept if marker.encode() in value]
