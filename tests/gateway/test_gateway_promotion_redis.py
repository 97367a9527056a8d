"""Hot-prefix counters in Redis: the same semantics as in memory, shared by two gateway apps, and a
Redis outage pauses promotion without touching requests."""

import asyncio
import random
import shutil
import subprocess
import time

import pytest

from gateway.app import create_app
from gateway.promotion_redis import RedisPromotionCounter
from gateway.state import POLICY_CACHE
from policies.promotion import (
    InMemoryPromotionCounter,
    PrefixHash,
    PromotionPolicy,
    SlidingWindowCounter,
    TenantTag,
)
from tests.gateway.conftest import ADMIN, make_config
from tests.gateway.test_gateway_canonicalization import system_with
from tests.gateway.test_gateway_e2e import auth, cached, chat_body
from tests.gateway.test_gateway_promotion import promoted_tokens, wait_for_hot_prefixes
from tests.tenancy.db_support import REDIS_ENV, service_url
from tests.worker_process import free_port


@pytest.fixture
def redis_url() -> str:
    import redis

    url = service_url(REDIS_ENV, "Redis")
    client = redis.Redis.from_url(url)
    for key in client.scan_iter(match="prefixgate:promo*"):
        client.delete(key)
    client.close()
    return url


async def test_redis_counter_matches_the_in_memory_counter(redis_url):
    rng = random.Random(7)
    redis_counter = RedisPromotionCounter(
        redis_url, salt=b"test-salt", max_tenants=3, key_prefix="prefixgate:promo-t"
    )
    memory = InMemoryPromotionCounter(SlidingWindowCounter(max_tenants=3))
    prefixes = [PrefixHash(f"{i:064x}") for i in range(3)]
    now = 1_800_000_000.0
    try:
        for _ in range(300):
            now += rng.choice([1, 5, 30, 61, 300, 900])
            hashes = rng.sample(prefixes, rng.randint(1, 3))
            tag = TenantTag(f"t-{rng.randint(0, 5)}")
            assert await redis_counter.record(hashes, tag, now) == await memory.record(hashes, tag, now)
            assert await redis_counter.stats(prefixes, now) == await memory.stats(prefixes, now)
            # Review r22: the stats of the tenants still opted in only, capped, agree too.
            among = frozenset(TenantTag(f"t-{i}") for i in rng.sample(range(6), rng.randint(0, 6)))
            for h in hashes:
                ours = await redis_counter.counted(h, now, among=among, max_hits_per_tenant_per_hour=2.0)
                assert ours == await memory.counted(h, now, among=among, max_hits_per_tenant_per_hour=2.0)
                assert ours[1] <= among and ours[0].num_tenants == len(ours[1])
        stats = await redis_counter.stats(prefixes, now)
        assert any(s.hits > 0 for s in stats) and max(s.num_tenants for s in stats) <= 3
        await redis_counter.forget(prefixes[0])
        await memory.forget(prefixes[0])
        assert await redis_counter.stats(prefixes, now) == await memory.stats(prefixes, now)
        assert (await redis_counter.stats(prefixes[:1], now))[0].hits == 0
        # A whole window later everything has expired.
        later = now + 3600
        assert all(s.hits == 0 and s.num_tenants == 0 for s in await redis_counter.stats(prefixes, later))
        # Keys are salted digests, never the global-form hash itself.
        keys = redis_counter.keys(prefixes[1])
        assert all(prefixes[1] not in key for key in keys)
        assert RedisPromotionCounter(redis_url, salt=b"other").keys(prefixes[1]) != keys
    finally:
        await redis_counter.close()


def promotion_config(database_url, data_dir, worker_url, redis_url, **changes):
    return make_config(
        database_url,
        data_dir,
        worker_urls=(worker_url,),
        redis_url=redis_url,
        promotion_min_hits=3,
        promotion_min_tenants=3,
        **changes,
    )


async def new_tenant(client, name: str) -> str:
    response = await client.post(
        "/admin/v1/tenants", json={"name": name, "share_hot_prefixes": True}, headers=ADMIN
    )
    assert response.status == 201, await response.text()
    return (await response.json())["api_key"]


async def ask(client, key: str, system: str, user: str) -> dict:
    for _ in range(40):  # a replica learns a new tenant with its next policy reload
        response = await client.post("/v1/chat/completions", json=chat_body(system, user), headers=auth(key))
        if response.status != 401:
            break
        await asyncio.sleep(0.05)
    assert response.status == 200, await response.text()
    return await response.json()


async def test_redis_counter_caps_each_tenant_at_its_share(redis_url):
    """Review r3 D5, the Redis (Lua) path: at (min_hits, k) = (14, 4) each tenant counts up to 4 hits, so
    three tenants of one party make 12 and a victim's one request 13, short of 14 ((9, 4), where a victim's
    request completed the promotion, is refused at startup); the victim's tenant at its cap promotes."""
    policy = PromotionPolicy(min_hits_per_hour=14, min_tenants=4)
    policy.check_threshold()
    share = policy.max_hits_per_tenant_per_hour
    counter = RedisPromotionCounter(redis_url, salt=b"test-salt", key_prefix="prefixgate:promo-cap")
    prefix, now = [PrefixHash("cd" * 32)], 1_800_000_000.0
    try:
        await counter.forget(prefix[0])
        for i in range(3):
            for _ in range(14):
                [stats] = await counter.record(
                    prefix, TenantTag(f"t-party-{i}"), now, max_hits_per_tenant_per_hour=share
                )
        assert stats.hits == 12  # 3 tenants × ceil(14 / 4)
        [stats] = await counter.record(prefix, TenantTag("t-victim"), now, max_hits_per_tenant_per_hour=share)
        assert stats.num_tenants == 4 and not policy.should_promote(stats)
        for _ in range(3):
            [stats] = await counter.record(
                prefix, TenantTag("t-victim"), now, max_hits_per_tenant_per_hour=share
            )
        assert stats.hits == 16 and policy.should_promote(stats)
    finally:
        await counter.forget(prefix[0])
        await counter.close()


async def test_two_replicas_share_counters_and_promotions(
    aiohttp_client, pg_url, tmp_path, worker_url, redis_url
):
    a = await aiohttp_client(create_app(promotion_config(pg_url, tmp_path / "a", worker_url, redis_url)))
    b = await aiohttp_client(create_app(promotion_config(pg_url, tmp_path / "b", worker_url, redis_url)))
    system = system_with("the replicated prompt")
    keys = [await new_tenant(a, name) for name in ("ra", "rb", "rc", "rd")]

    # One hit on replica a, two on b: only shared counters see three tenants.
    assert promoted_tokens(await ask(a, keys[0], system, "qa")) == 0
    assert promoted_tokens(await ask(b, keys[1], system, "qb")) == 0
    promoting = await ask(b, keys[2], system, "qc")
    assert promoted_tokens(promoting) == 0  # counted once served; it learns nothing
    (row,) = await wait_for_hot_prefixes(a, 1)
    promoted = row["num_tokens"]
    assert promoted > 1600 and row["num_tenants"] == 3

    # Replica a learns the promotion from SQL with its policy reload, then serves the promoted copy.
    deadline = time.monotonic() + 2.0
    while not a.app[POLICY_CACHE].promoted_hashes:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    fourth = await ask(a, keys[3], system, "qd")  # not a contributor: never told
    assert promoted_tokens(fourth) == 0
    on_a = await ask(a, keys[0], system, "qa again")
    assert cached(on_a) >= promoted  # the promoted copy fourth made
    assert promoted_tokens(on_a) == 0  # only the replica that promoted knows who contributed
    on_b = await ask(b, keys[1], system, "qb again")
    assert promoted_tokens(on_b) == promoted


async def counter_errors(client) -> float:
    text = await (await client.get("/metrics", headers=ADMIN)).text()
    (line,) = [
        line for line in text.splitlines() if line.startswith("prefixgate_promotion_counter_errors_total")
    ]
    return float(line.split()[-1])


async def test_redis_unreachable_pauses_promotion_and_serves_requests(
    aiohttp_client, sqlite_url, tmp_path, worker_url
):
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    client = await aiohttp_client(
        create_app(promotion_config(sqlite_url, tmp_path, worker_url, dead, promotion_pause_s=0.0))
    )
    system = system_with("nobody counts this")
    for name in ("x", "y", "z", "w"):
        result = await ask(client, await new_tenant(client, name), system, name)
        assert promoted_tokens(result) == 0
    assert await counter_errors(client) >= 4
    assert (await (await client.get("/admin/v1/hot-prefixes", headers=ADMIN)).json())["data"] == []


def start_redis(port: int, directory) -> subprocess.Popen:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    server = subprocess.Popen(
        [binary, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(directory)],
        stdout=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            return server
        except redis.ConnectionError:
            time.sleep(0.05)
    server.kill()
    raise RuntimeError("redis-server did not start")


async def test_redis_dying_mid_run_pauses_promotion_until_it_is_back(
    aiohttp_client, sqlite_url, tmp_path, worker_url
):
    port = free_port()
    server = start_redis(port, tmp_path)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        client = await aiohttp_client(
            create_app(promotion_config(sqlite_url, tmp_path, worker_url, url, promotion_pause_s=0.3))
        )
        system = system_with("counted, then not")
        keys = [await new_tenant(client, name) for name in ("p", "q", "r")]
        await ask(client, keys[0], system, "1")
        await ask(client, keys[1], system, "2")
        server.kill()
        server.wait(timeout=10)
        third = await ask(client, keys[2], system, "3")  # would promote; Redis is gone
        assert promoted_tokens(third) == 0 and cached(third) == 0
        assert await counter_errors(client) >= 1

        server = start_redis(port, tmp_path)  # back, empty: counting starts over after the pause
        await asyncio.sleep(0.4)
        results = [await ask(client, key, system, f"again {i}") for i, key in enumerate(keys)]
        assert [promoted_tokens(r) for r in results] == [0, 0, 0]  # the third completes the count
        await wait_for_hot_prefixes(client, 1)
        assert promoted_tokens(await ask(client, keys[0], system, "after")) > 0
    finally:
        server.kill()
        server.wait(timeout=10)
