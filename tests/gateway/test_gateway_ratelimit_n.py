"""``n`` choices are ``n`` generations: a request with ``n`` counts ``n`` against the tenant's requests per
minute and concurrent requests (issue 13), so ``n`` cannot be used to exceed either limit.

Real gateway, real SQLite (and Redis for the shared window), the real worker process, the openai SDK.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import openai
import pytest
from openai import AsyncOpenAI

from gateway.admission import AdmissionGate, admit_choices
from gateway.app import create_app
from gateway.config import OpenAIUpstreamConfig
from gateway.errors import RateLimited
from gateway.ratelimit import WINDOW_S, LocalRateLimiter, RedisRateLimiter, requests_key
from gateway.state import ADMISSION
from tenancy.policy import TenantPolicy
from tests.gateway.conftest import create_tenant, make_config
from tests.tenancy.db_support import REDIS_ENV, service_url
from tests.upstreams import hung_server

MODEL = "random-tiny"
HELD_MODEL = "held"  # served by an external upstream that never answers (test_n_counts_n_concurrent_requests)
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(params=["local", "redis"])
async def limited_gateway(request, aiohttp_client, sqlite_url, tmp_path, worker_url):
    redis_url = service_url(REDIS_ENV, "Redis") if request.param == "redis" else None
    config = make_config(sqlite_url, tmp_path, worker_urls=(worker_url,), redis_url=redis_url)
    return await aiohttp_client(create_app(config))


async def tenant_sdk(gateway, **limits) -> AsyncOpenAI:
    key = (await create_tenant(gateway, name=f"t{time.monotonic_ns()}", **limits))["api_key"]
    return AsyncOpenAI(base_url=str(gateway.make_url("/v1")), api_key=key, max_retries=0)


async def chat(sdk: AsyncOpenAI, n: int, **extra):
    """The raw response (headers) of a chat request with ``n`` choices."""
    return await sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, n=n, max_tokens=2, **extra
    )


async def in_one_window() -> None:
    """Keep a few requests inside one fixed Redis window (the local limiter's is sliding)."""
    if time.time() % WINDOW_S > WINDOW_S - 3:
        await asyncio.sleep(WINDOW_S - time.time() % WINDOW_S)


async def test_n_counts_n_requests_per_minute(limited_gateway):
    sdk = await tenant_sdk(limited_gateway, rate_limit_rpm=5)
    await in_one_window()
    raw = await chat(sdk, n=3)
    assert len(raw.parse().choices) == 3
    assert raw.headers["x-ratelimit-limit-requests"] == "5"
    assert raw.headers["x-ratelimit-remaining-requests"] == "2"  # 3 of 5 used, not 1
    with pytest.raises(openai.RateLimitError) as refused:
        await chat(sdk, n=3)
    error = refused.value.body
    assert refused.value.status_code == 429 and error["type"] == "rate_limit_error"
    assert error["code"] == "rate_limit_exceeded" and "n=3" in error["message"], error
    assert int(refused.value.response.headers["Retry-After"]) >= 1
    assert refused.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    # A refused request counts nothing: the two requests left still serve, one n=2 request included.
    raw = await chat(sdk, n=2)
    assert len(raw.parse().choices) == 2 and raw.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(openai.RateLimitError):
        await chat(sdk, n=1)
    await sdk.close()


async def test_streamed_n_counts_n_requests_per_minute(limited_gateway):
    sdk = await tenant_sdk(limited_gateway, rate_limit_rpm=4)
    await in_one_window()
    raw = await chat(sdk, n=4, stream=True)
    assert raw.headers["x-ratelimit-remaining-requests"] == "0"
    indexes = {choice.index async for chunk in raw.parse() for choice in chunk.choices}
    assert indexes == {0, 1, 2, 3}
    with pytest.raises(openai.RateLimitError):
        await chat(sdk, n=1, stream=True)
    await sdk.close()


async def test_n_larger_than_the_limit_can_never_fit(limited_gateway):
    sdk = await tenant_sdk(limited_gateway, rate_limit_rpm=2)
    await in_one_window()
    with pytest.raises(openai.RateLimitError) as refused:
        await chat(sdk, n=3)
    error = refused.value.body
    assert error["code"] == "n_exceeds_limit" and error["param"] == "n", error
    assert "can never" in error["message"] and "2 requests per minute" in error["message"]
    raw = await chat(sdk, n=2)  # and it counted nothing
    assert raw.headers["x-ratelimit-remaining-requests"] == "0"
    await sdk.close()


async def wait_until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_n_counts_n_concurrent_requests(aiohttp_client, sqlite_url, tmp_path, worker_url):
    """A request with 3 choices holds 3 of the tenant's 4 slots for as long as the test wants: it goes to
    an external upstream that takes the connection and never answers (a kernel listener that never
    accepts), until the test closes that listener (the request then fails and gives its slots back).
    No timing: every check waits on the admission gate's state."""
    with hung_server() as hung:
        held_upstream = OpenAIUpstreamConfig(
            name="held", urls=(hung,), models=((HELD_MODEL, MODEL),), probe_interval_s=0
        )
        config = make_config(
            sqlite_url, tmp_path, worker_urls=(worker_url,), openai_upstreams=(held_upstream,)
        )
        gateway = await aiohttp_client(create_app(config))
        sdk = await tenant_sdk(gateway, max_concurrent_requests=4)
        other = await tenant_sdk(gateway)
        gate = gateway.app[ADMISSION]
        held = asyncio.create_task(
            sdk.chat.completions.create(model=HELD_MODEL, messages=MESSAGES, n=3, max_tokens=2, stream=True)
        )
        await wait_until(lambda: sum(gate.tenant_to_in_flight.values()) == 3)
        with pytest.raises(openai.RateLimitError) as refused:
            await chat(sdk, n=2)
        error = refused.value.body
        assert error["code"] == "concurrency_limit_exceeded" and "n=2" in error["message"], error
        assert refused.value.response.headers["Retry-After"]
        assert len((await chat(sdk, n=1)).parse().choices) == 1  # 3 + 1 fit
        assert len((await chat(other, n=4)).parse().choices) == 4  # another tenant is not limited
        assert not held.done() and sum(gate.tenant_to_in_flight.values()) == 3  # still held
    # The listener is closed: the held request's connection is reset, it fails, its slots come back.
    with pytest.raises(openai.APIStatusError):
        await held
    await wait_until(lambda: not gate.tenant_to_in_flight)
    assert len((await chat(sdk, n=4)).parse().choices) == 4
    with pytest.raises(openai.RateLimitError) as refused:
        await chat(sdk, n=5)
    assert refused.value.body["code"] == "n_exceeds_limit", refused.value.body
    assert "4 concurrent requests" in refused.value.body["message"]
    await wait_until(lambda: not gate.tenant_to_in_flight)
    await sdk.close()
    await other.close()


async def test_local_limiter_refund():
    limiter = LocalRateLimiter(window_s=60)
    assert limiter.check_at("t", 3, 1, now=0).allowed
    second = limiter.check_at("t", 3, 1, now=1)
    assert second.allowed and not limiter.check_at("t", 3, 2, now=1).allowed
    limiter.refund_at("t", 1, second.counted, now=1)  # gives back the second check's unit
    assert limiter.check_at("t", 3, 2, now=2).remaining == 0
    assert limiter.check_at("t", 3, 1, now=60.5).allowed  # the hit at 0 left the window, the one at 1 not
    assert not limiter.check_at("t", 3, 1, now=60.5).allowed
    await limiter.refund("nobody", 5, second.counted)  # nothing counted: nothing to give back
    assert limiter.check_at("nobody", 3, 3, now=2).allowed


@pytest.fixture(params=["local", "redis"])
async def limiter(request):
    if request.param == "local":
        yield LocalRateLimiter()
        return
    shared = RedisRateLimiter(service_url(REDIS_ENV, "Redis"), key_prefix=f"test:{secrets.token_hex(4)}")
    yield shared
    await shared.close()


async def test_a_refused_n_counts_nothing_on_either_limiter(limiter):
    """rpm 2: one request served, then one with n=2 refused (its second choice does not fit): it counts
    nothing, on Redis too (review r6 #5: Redis kept a refused check's single unit), so one more fits."""
    tenant = TenantPolicy(tenant_id=f"tn_{secrets.token_hex(6)}", name="t", rate_limit_rpm=2)
    key, gate = requests_key(tenant.tenant_id), AdmissionGate(max_in_flight=0)
    await in_one_window()
    assert (await limiter.check(key, 2)).allowed
    first = await limiter.check(key, 2)  # the n=2 request enters with its first unit
    assert first.allowed
    gate.enter(tenant.tenant_id, None)
    with pytest.raises(RateLimited):
        await admit_choices(gate, limiter, tenant, 2, {}, first.counted)
    gate.leave(tenant.tenant_id, 1)
    last = await limiter.check(key, 2)
    assert last.allowed and last.remaining == 0  # 1 served + this one
    assert not (await limiter.check(key, 2)).allowed
    assert not (await limiter.check(key, 2, 2)).allowed  # refused checks of any cost count nothing ...
    await limiter.refund(key, 1, last.counted)
    assert (await limiter.check(key, 2)).allowed  # ... so a refund frees a unit
