"""Tenant rate limits: per replica by default, shared between replicas through Redis."""

import asyncio
import time

import pytest

from gateway import ratelimit
from gateway.app import create_app
from gateway.ratelimit import WINDOW_S, LocalRateLimiter, RedisRateLimiter, tokens_key
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
        first = await limiter.check("t", 100, 30)
        assert first.remaining == 70
        await limiter.charge("t", 90)  # it used 120, not 30: past the limit, counted all the same
        refused = await limiter.check("t", 100, 1)
        assert not refused.allowed and refused.remaining == 0
        await limiter.refund("t", 30, first.counted)  # 90 used
        assert (await limiter.check("t", 100, 10)).remaining == 0
        await limiter.charge("other", 5)
        assert (await limiter.check("other", 10, 5)).remaining == 0
    finally:
        await limiter.close()


async def test_a_redis_refund_lands_in_the_window_that_was_charged(monkeypatch, redis_url):
    """A stream checked at the end of one minute and settled in the next gave its unused estimate back
    into the next minute, which never counted it: 18,100 tokens in one minute under a limit of 10,000
    (review r8 #4). A refund goes back to its check's window while it is current, else nowhere."""
    limiter = RedisRateLimiter(redis_url, key_prefix=f"test:{time.time_ns()}")
    key, limit = tokens_key("tn_a"), 10_000
    base = 1_000_000 * WINDOW_S  # the start of a window
    now = [base + WINDOW_S - 0.5]
    monkeypatch.setattr(ratelimit.time, "time", lambda: now[0])
    try:
        first = await limiter.check(key, limit, 9_000)  # A: a stream checked at the end of minute W
        assert first.allowed
        now[0] = base + WINDOW_S + 0.5  # minute W + 1
        assert (await limiter.check(key, limit, 9_000)).allowed  # B: 9,000 really used in W + 1
        await limiter.refund(key, 8_900, first.counted)  # A ends in W + 1 having used 100
        assert not (await limiter.check(key, limit, 9_000)).allowed  # C: 18,000 > 10,000 in W + 1
        # Within its own window a refund gives the room back.
        now[0] = base + 2 * WINDOW_S + 1
        second = await limiter.check(key, limit, 9_000)
        assert not (await limiter.check(key, limit, 2_000)).allowed
        await limiter.refund(key, 8_000, second.counted)
        assert (await limiter.check(key, limit, 9_000)).remaining == 0  # 1,000 + 9,000
    finally:
        await limiter.close()


async def test_a_local_refund_comes_off_its_own_check_while_it_is_in_the_window():
    """Locally the window slides: a refund comes off the refunded check's own hit (it took the newest
    hits, another request's, which count longer), and not at all once that hit has left the window."""
    limiter = LocalRateLimiter(window_s=60)
    first = limiter.check_at("t", 10_000, 5_000, now=0)
    assert limiter.check_at("t", 10_000, 4_000, now=1).allowed  # another request's 4,000
    limiter.refund_at("t", 4_900, first.counted, now=2)  # the first used 100 of its 5,000
    assert limiter.check_at("t", 10_000, 900, now=3).remaining == 5_000
    # At 60.5 the first request's hit (100) and its refund have left; the other's 4,000 and 900 count.
    assert not limiter.check_at("t", 10_000, 5_101, now=60.5).allowed
    assert limiter.check_at("t", 10_000, 5_100, now=60.5).remaining == 0
    # The reviewer's case, locally: a check whose hit has left the window refunds nothing.
    late = LocalRateLimiter(window_s=60)
    a = late.check_at("t", 10_000, 9_000, now=0)
    assert late.check_at("t", 10_000, 9_000, now=60.5).allowed
    late.refund_at("t", 8_900, a.counted, now=61)
    assert not late.check_at("t", 10_000, 9_000, now=61).allowed


async def test_a_check_counted_locally_while_redis_is_paused_is_refunded_locally():
    limiter = RedisRateLimiter("redis://127.0.0.1:9/0", key_prefix="test:paused", timeout_s=0.05)
    try:
        first = await limiter.check("t", 10, 8)  # Redis fails: counted in the local fallback
        assert limiter.paused and first.allowed and first.counted.local_s is not None
        assert not (await limiter.check("t", 10, 5)).allowed
        await limiter.refund("t", 6, first.counted)
        assert (await limiter.check("t", 10, 8)).remaining == 0
    finally:
        await limiter.close()
