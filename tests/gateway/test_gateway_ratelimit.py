"""Tenant rate limits: per replica by default, shared between replicas through Redis."""

import asyncio
import time

import pytest

from gateway.app import create_app
from gateway.ratelimit import WINDOW_S, LocalRateLimiter, RedisRateLimiter
from gateway.state import POLICY_CACHE
from tests.gateway.conftest import ADMIN, make_config
from tests.tenancy.db_support import REDIS_ENV, service_url


def test_local_sliding_window():
    limiter = LocalRateLimiter(window_s=60)
    assert [limiter.allow_at("t", 2, now) for now in (0, 1, 2)] == [True, True, False]
    assert limiter.allow_at("t", 2, 60.5) is True  # the first hit left the window
    assert limiter.allow_at("other", 2, 2) is True and limiter.allow_at("t", None, 2) is True


async def status(client, key: str) -> int:
    response = await client.post(
        "/v1/completions", json={"model": "m", "prompt": "x"}, headers={"Authorization": f"Bearer {key}"}
    )
    return response.status


@pytest.fixture
def redis_url() -> str:
    return service_url(REDIS_ENV, "Redis")


async def test_redis_limit_is_shared_by_replicas(aiohttp_client, pg_url, tmp_path, redis_url):
    a = await aiohttp_client(create_app(make_config(pg_url, tmp_path / "a", redis_url=redis_url)))
    b = await aiohttp_client(create_app(make_config(pg_url, tmp_path / "b", redis_url=redis_url)))
    created = await (
        await a.post("/admin/v1/tenants", json={"name": "limited", "rate_limit_rpm": 3}, headers=ADMIN)
    ).json()
    key = created["api_key"]
    await b.app[POLICY_CACHE].reload()
    if time.time() % WINDOW_S > WINDOW_S - 2:  # keep the four requests inside one fixed window
        await asyncio.sleep(WINDOW_S - time.time() % WINDOW_S)
    # No worker runs here: allowed requests end in 503, refused ones in 429.
    statuses = [await status(a, key), await status(b, key), await status(a, key), await status(b, key)]
    assert statuses == [503, 503, 503, 429]


async def test_unreachable_redis_falls_back_to_local_limits(aiohttp_client, sqlite_url, tmp_path):
    client = await aiohttp_client(
        create_app(make_config(sqlite_url, tmp_path, redis_url="redis://127.0.0.1:9/0"))
    )
    created = await (
        await client.post("/admin/v1/tenants", json={"name": "limited", "rate_limit_rpm": 1}, headers=ADMIN)
    ).json()
    assert [await status(client, created["api_key"]) for _ in range(2)] == [503, 429]


@pytest.mark.parametrize("backend", ["local", "redis"])
async def test_charge_counts_what_a_request_used_beyond_its_check(backend, request):
    """A request's real tokens (known once answered) count in the window though no check is left to
    refuse them: the next request is refused on them. ``charge`` never refuses, even past the limit."""
    if backend == "local":
        limiter = LocalRateLimiter()
    else:
        limiter = RedisRateLimiter(request.getfixturevalue("redis_url"), key_prefix=f"test:{time.time_ns()}")
    if time.time() % WINDOW_S > WINDOW_S - 2:  # one fixed Redis window for the whole test
        await asyncio.sleep(WINDOW_S - time.time() % WINDOW_S)
    try:
        assert (await limiter.check("t", 100, 30)).remaining == 70
        await limiter.charge("t", 90)  # it used 120, not 30: past the limit, counted all the same
        refused = await limiter.check("t", 100, 1)
        assert not refused.allowed and refused.remaining == 0
        await limiter.refund("t", 40)  # 80 used
        assert (await limiter.check("t", 100, 20)).remaining == 0
        await limiter.charge("other", 5)
        assert (await limiter.check("other", 10, 5)).remaining == 0
    finally:
        await limiter.close()
