"""Backpressure in the gateway: tenant limits (429), gateway bounds (503), headers, size checks, CPU pool.

Real app, real SQLite, the real worker process (random-tiny) where a request must reach a worker.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

from gateway.app import create_app
from gateway.ratelimit import LocalRateLimiter, format_reset
from tests.gateway.conftest import ADMIN, make_config

MODEL = "random-tiny"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def new_tenant(client, **fields) -> str:
    response = await client.post("/admin/v1/tenants", json={"name": "t", **fields}, headers=ADMIN)
    assert response.status == 201, await response.text()
    return (await response.json())["api_key"]


def chat(content: str = "hello", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


async def post(client, key: str, body: dict):
    response = await client.post("/v1/chat/completions", json=body, headers=auth(key))
    return response.status, dict(response.headers), await response.json()


def test_local_limiter_weights_and_reset():
    limiter = LocalRateLimiter(window_s=60)
    first = limiter.check_at("t", 100, 60, now=0)
    assert first.allowed and first.remaining == 40 and first.reset_s == 60
    refused = limiter.check_at("t", 100, 50, now=10)
    assert not refused.allowed and refused.remaining == 0 and refused.reset_s == 50
    assert limiter.check_at("t", 100, 40, now=10).allowed  # a refused request used nothing
    assert limiter.check_at("t", 100, 50, now=60.5).allowed  # the first one left the window
    assert format_reset(0.02) == "20ms" and format_reset(1.2) == "2s" and format_reset(360) == "6m0s"


async def test_rpm_answers_headers_and_429_with_retry_after(aiohttp_client, sqlite_url, tmp_path, worker_url):
    client = await aiohttp_client(create_app(make_config(sqlite_url, tmp_path, worker_urls=(worker_url,))))
    key = await new_tenant(client, rate_limit_rpm=2)
    status, headers, _ = await post(client, key, chat(max_tokens=2))
    assert status == 200
    assert headers["x-ratelimit-limit-requests"] == "2" and headers["x-ratelimit-remaining-requests"] == "1"
    assert headers["x-ratelimit-reset-requests"].endswith("s")
    await post(client, key, chat(max_tokens=2))
    status, headers, body = await post(client, key, chat(max_tokens=2))
    assert status == 429 and body["error"]["type"] == "rate_limit_error"
    assert int(headers["Retry-After"]) >= 1 and headers["x-ratelimit-remaining-requests"] == "0"


async def test_tokens_per_minute_counts_every_choice(aiohttp_client, sqlite_url, tmp_path, worker_url):
    """``n`` choices may each generate ``max_tokens``: the token limit counts them all, as OpenAI's does."""
    client = await aiohttp_client(create_app(make_config(sqlite_url, tmp_path, worker_urls=(worker_url,))))
    key = await new_tenant(client, rate_limit_tpm=300)
    status, headers, body = await post(client, key, chat(max_tokens=60, n=3))
    assert status == 200, body
    prompt_tokens = body["usage"]["prompt_tokens"]
    assert headers["x-ratelimit-remaining-tokens"] == str(300 - prompt_tokens - 3 * 60)
    status, _, body = await post(client, key, chat(max_tokens=100, n=3))
    assert status == 429 and body["error"]["code"] == "tokens_exceeded", body  # 3 x 100 can never fit


async def test_tokens_per_minute_limit(aiohttp_client, sqlite_url, tmp_path, worker_url):
    client = await aiohttp_client(create_app(make_config(sqlite_url, tmp_path, worker_urls=(worker_url,))))
    key = await new_tenant(client, rate_limit_tpm=200)
    # ignore_eos: each answer takes its max_tokens, so the window (settled to what was used) keeps them.
    status, headers, body = await post(client, key, chat(max_tokens=60, ignore_eos=True))
    assert status == 200, body
    prompt_tokens = body["usage"]["prompt_tokens"]
    left = 200 - prompt_tokens - 60  # prompt + max_tokens are counted
    assert headers["x-ratelimit-limit-tokens"] == "200"
    assert headers["x-ratelimit-remaining-tokens"] == str(left)
    status, headers, body = await post(client, key, chat(max_tokens=left - prompt_tokens + 1))  # 1 too many
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded", body
    assert int(headers["Retry-After"]) >= 1 and headers["x-ratelimit-remaining-tokens"] == "0"
    status, _, body = await post(client, key, chat(max_tokens=500))
    assert status == 429 and body["error"]["code"] == "tokens_exceeded"  # can never fit
    status, headers, _ = await post(client, key, chat(max_tokens=left - prompt_tokens, ignore_eos=True))
    assert status == 200 and headers["x-ratelimit-remaining-tokens"] == "0"  # what was left still serves
    metrics = await (await client.get("/metrics", headers=ADMIN)).text()
    counted = [line for line in metrics.splitlines() if line.startswith("prefixgate_prompt_tokens_total{")]
    assert counted and counted[0].endswith(f" {2 * prompt_tokens}.0"), counted  # refused ones bill nothing


async def burst(client, key: str, n: int, **extra) -> list[tuple[int, dict, dict]]:
    return await asyncio.gather(*(post(client, key, chat(f"burst {i}", **extra)) for i in range(n)))


async def test_tenant_concurrency_limit_refuses_fast_with_429(
    aiohttp_client, sqlite_url, tmp_path, worker_url
):
    client = await aiohttp_client(create_app(make_config(sqlite_url, tmp_path, worker_urls=(worker_url,))))
    key = await new_tenant(client, max_concurrent_requests=2)
    other = await new_tenant(client, name="other")
    results = await burst(client, key, 8, max_tokens=64, ignore_eos=True)
    statuses = sorted(status for status, _, _ in results)
    assert set(statuses) == {200, 429} and statuses.count(200) >= 2, statuses
    refused = [(h, b) for s, h, b in results if s == 429]
    assert all(b["error"]["code"] == "concurrency_limit_exceeded" and h["Retry-After"] for h, b in refused)
    assert (await post(client, other, chat(max_tokens=2)))[0] == 200  # another tenant is not limited
    assert (await post(client, key, chat(max_tokens=2)))[0] == 200  # and the slots were given back


async def test_gateway_in_flight_bound_answers_503(aiohttp_client, sqlite_url, tmp_path, worker_url):
    config = make_config(
        sqlite_url, tmp_path, worker_urls=(worker_url,), max_in_flight=2, tenant_in_flight_share=1.0
    )
    client = await aiohttp_client(create_app(config))
    key = await new_tenant(client)
    results = await burst(client, key, 8, max_tokens=64, ignore_eos=True)
    statuses = sorted(status for status, _, _ in results)
    assert set(statuses) == {200, 503} and statuses.count(200) >= 2, statuses
    overloaded = [(h, b) for s, h, b in results if s == 503]
    assert all(b["error"]["code"] == "server_overloaded" and h["Retry-After"] == "1" for h, b in overloaded)
    metrics = await (await client.get("/metrics", headers=ADMIN)).text()
    assert "prefixgate_queue_seconds_count" in metrics and "prefixgate_requests_in_flight 0.0" in metrics


async def test_ttft_histogram_counts_streamed_requests(gateway):
    key = await new_tenant(gateway)
    response = await gateway.post(
        "/v1/chat/completions", json=chat(max_tokens=4, stream=True), headers=auth(key)
    )
    assert response.status == 200
    await response.read()
    metrics = await (await gateway.get("/metrics", headers=ADMIN)).text()
    assert 'prefixgate_time_to_first_token_seconds_count{endpoint="chat.completions"} 1.0' in metrics


async def test_prompt_size_limits_are_checked_before_rendering(
    aiohttp_client, sqlite_url, tmp_path, worker_url
):
    config = make_config(sqlite_url, tmp_path, worker_urls=(worker_url,), max_prompt_chars=100_000)
    client = await aiohttp_client(create_app(config))
    key = await new_tenant(client)
    status, _, body = await post(client, key, chat("x " * 60_000))
    assert status == 413 and body["error"]["param"] == "messages", body
    started = time.perf_counter()
    status, _, body = await post(client, key, chat("word" * 20_000))  # far past the context window
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert time.perf_counter() - started < 2


def post_in_thread(url: str, key: str, body: dict) -> int:
    """POST from another thread, so that building and sending 4 MB does not use the event loop."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={**auth(key), "Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


HUGE_TEXT = (
    "Note 2026-11-29T14:03:22Z id 9f86d081-884c-7d65-9a2f-eaa0c55ad015: the quick brown fox. " * 42_000
)


@pytest.mark.parametrize(
    ("max_prompt_chars", "text", "expected"),
    [
        (1_000_000, HUGE_TEXT, 413),  # the gateway's character limit
        (0, HUGE_TEXT, 400),  # no character limit: more non-blank characters than the context holds
        (0, ("lorem " + " " * 200) * 19_000, 400),  # mostly blanks: rendered and tokenized on the pool
    ],
    ids=["char-limit", "context-bound", "rendered"],
)
async def test_a_huge_chat_body_does_not_stall_other_tenants(
    aiohttp_client, sqlite_url, tmp_path, worker_url, max_prompt_chars, text, expected
):
    """While one tenant posts ~3.9 MB of chat (canonicalization on), another tenant's small requests
    are answered promptly."""
    config = make_config(sqlite_url, tmp_path, worker_urls=(worker_url,), max_prompt_chars=max_prompt_chars)
    gateway = await aiohttp_client(create_app(config))
    big = await new_tenant(gateway, name="big", canonicalization="on")
    small = await new_tenant(gateway, name="small")
    assert (await post(gateway, small, chat(max_tokens=2)))[0] == 200  # warm up
    url = str(gateway.make_url("/v1/chat/completions"))
    huge = asyncio.create_task(asyncio.to_thread(post_in_thread, url, big, chat(text)))
    latencies = []
    while not huge.done() or len(latencies) < 3:
        started = time.perf_counter()
        status, _, body = await post(gateway, small, chat(max_tokens=2))
        latencies.append(time.perf_counter() - started)
        assert status == 200, body
        await asyncio.sleep(0.05)
    assert await huge == expected
    assert max(latencies) < 2, latencies


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 2.5),
        ("top_p", 1.5),
        ("top_k", -1),
        ("top_k", 2**40),
        ("max_tokens", 0),
        ("seed", 2**70),
    ],
)
async def test_out_of_range_sampling_values_are_400_naming_the_parameter(client, field, value):
    key = await new_tenant(client)
    status, _, body = await post(client, key, chat(**{field: value}))
    assert status == 400 and body["error"]["param"] == field, body


async def test_prompt_lint_cost_is_linear_in_the_input(gateway):
    """400 KB with a fragment every ~500 bytes: linted in seconds, not tokenized once per fragment."""
    key = await new_tenant(gateway)
    document = "".join(
        f"Entry {i} at 2026-11-29T14:{i % 60:02d}:22Z. " + "lorem ipsum " * 36 for i in range(800)
    )
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": document}, {"role": "user", "content": "QUESTION"}],
    }
    started = time.perf_counter()
    response = await gateway.post("/v1/prompt-lint", json=body, headers=auth(key))
    elapsed_s = time.perf_counter() - started
    lint = await response.json()
    assert response.status == 200, lint
    assert len(lint["fragments"]) >= 800 and lint["fragments"][0]["token_offset"] is not None
    assert lint["reuse_cost_tokens"] > 0
    assert elapsed_s < 10, elapsed_s


def test_backpressure_settings_come_from_the_environment():
    from gateway.config import load_config

    env = {
        "PREFIXGATE_MAX_IN_FLIGHT": "0",
        "PREFIXGATE_MAX_PROMPT_CHARS": "5000",
        "PREFIXGATE_CPU_THREADS": "2",
        "PREFIXGATE_WORKER_HEALTH_TIMEOUT_S": "0.5",
        "PREFIXGATE_RATELIMIT_PAUSE_S": "1",
    }
    config = load_config(env=env)
    assert (config.max_in_flight, config.max_prompt_chars, config.cpu_threads) == (0, 5000, 2)
    assert (config.worker_health_timeout_s, config.ratelimit_pause_s) == (0.5, 1.0)


async def test_tenant_limits_are_policy_fields(client):
    created = await (
        await client.post(
            "/admin/v1/tenants",
            json={"name": "lim", "max_concurrent_requests": 3, "rate_limit_tpm": 1000},
            headers=ADMIN,
        )
    ).json()
    tenant_id = created["id"]
    response = await client.patch(
        f"/admin/v1/tenants/{tenant_id}", json={"max_concurrent_requests": None}, headers=ADMIN
    )
    assert response.status == 200, await response.text()
    tenant = await (await client.get(f"/admin/v1/tenants/{tenant_id}", headers=ADMIN)).json()
    assert tenant["max_concurrent_requests"] is None and tenant["rate_limit_tpm"] == 1000
    bad = await client.patch(f"/admin/v1/tenants/{tenant_id}", json={"rate_limit_tpm": -1}, headers=ADMIN)
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "rate_limit_tpm"


async def test_token_limit_is_shared_by_replicas_through_redis(aiohttp_client, pg_url, tmp_path, worker_url):
    from gateway.ratelimit import WINDOW_S
    from gateway.state import POLICY_CACHE
    from tests.tenancy.db_support import REDIS_ENV, service_url

    redis_url = service_url(REDIS_ENV, "Redis")
    replicas = [
        await aiohttp_client(
            create_app(make_config(pg_url, tmp_path / name, worker_urls=(worker_url,), redis_url=redis_url))
        )
        for name in ("a", "b")
    ]
    key = await new_tenant(replicas[0], name=f"tpm-{time.time_ns()}", rate_limit_tpm=150)
    await replicas[1].app[POLICY_CACHE].reload()
    if time.time() % WINDOW_S > WINDOW_S - 3:  # keep the requests inside one fixed window
        await asyncio.sleep(WINDOW_S - time.time() % WINDOW_S)
    first = await post(replicas[0], key, chat(max_tokens=70, ignore_eos=True))  # uses all 70: kept
    second = await post(replicas[1], key, chat(max_tokens=70, ignore_eos=True))
    assert first[0] == 200 and second[0] == 429, (first, second)  # 2 x (prompt + 70) > 150 together
    assert second[1]["x-ratelimit-limit-tokens"] == "150"


async def test_cpu_pool_runs_off_the_loop_and_refuses_past_its_queue():
    import threading

    from gateway.cpu import CpuPool
    from gateway.errors import Unavailable

    pool = CpuPool(num_threads=1, max_waiting=1)
    release = threading.Event()
    try:
        running = asyncio.create_task(pool.run(release.wait, 10))
        await asyncio.sleep(0.05)
        waiting = asyncio.create_task(pool.run(threading.get_ident))
        await asyncio.sleep(0.05)
        with pytest.raises(Unavailable) as refused:
            await pool.run(threading.get_ident)
        assert refused.value.code == "server_busy" and refused.value.retry_after_s == 1
        release.set()
        assert await running is True and await waiting != threading.get_ident()  # not the loop's thread
    finally:
        release.set()
        pool.close()


async def test_cpu_pool_gives_each_owner_a_share_and_refuses_its_own_flood():
    """One owner's jobs past its share wait for its own threads, not the common ones."""
    import threading

    from gateway.cpu import CpuPool
    from gateway.errors import RateLimited

    pool = CpuPool(num_threads=2, max_waiting=8, per_owner=1, per_owner_waiting=2)
    release = threading.Event()
    try:
        flood = [asyncio.create_task(pool.run_for("tenant-a", release.wait, 30)) for _ in range(3)]
        await asyncio.sleep(0.05)
        with pytest.raises(RateLimited) as refused:  # 1 running + 2 waiting: its fourth is its own 429
            await pool.run_for("tenant-a", threading.get_ident)
        assert refused.value.code == "too_many_prompts_in_preparation"
        other = await asyncio.wait_for(pool.run_for("tenant-b", threading.get_ident), 30)
        assert other != threading.get_ident() and not any(task.done() for task in flood)
        release.set()
        assert await asyncio.gather(*flood) == [True, True, True]
        assert pool._shares == {}  # nothing kept per owner once its jobs are done
    finally:
        release.set()
        pool.close()


async def test_a_tenant_flooding_prompt_lint_neither_blocks_another_tenant_nor_exceeds_its_limit(
    aiohttp_client, sqlite_url, tmp_path, worker_url, monkeypatch
):
    """Four 1 MB lints of one tenant on the 4-thread pool made another tenant's chat wait 30 s, and a
    lint took no admission slot. Here the lints block until released: the other tenant is served
    meanwhile, and the flooding tenant's lints count against its max_concurrent_requests."""
    import threading

    from gateway.state import CANONICALIZER

    app = create_app(make_config(sqlite_url, tmp_path, worker_urls=(worker_url,), cpu_threads=2))
    gateway = await aiohttp_client(app)
    release, started = threading.Event(), threading.Semaphore(0)
    lint = app[CANONICALIZER].lint

    def blocking_lint(*args):
        started.release()
        release.wait(60)
        return lint(*args)

    monkeypatch.setattr(app[CANONICALIZER], "lint", blocking_lint)
    flooder = await new_tenant(gateway, name="flooder", max_concurrent_requests=3)
    other = await new_tenant(gateway, name="other")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "at 2026-11-29T14:00:22Z"}]}
    try:
        lints = [
            asyncio.create_task(gateway.post("/v1/prompt-lint", json=body, headers=auth(flooder)))
            for _ in range(3)
        ]
        await asyncio.to_thread(started.acquire, True, 30)  # one runs (its share of 2 threads: 1)
        refused = await gateway.post("/v1/prompt-lint", json=body, headers=auth(flooder))
        assert refused.status == 429, await refused.text()  # its fourth: over max_concurrent_requests
        served = await asyncio.wait_for(post(gateway, other, chat(max_tokens=1)), 60)
        assert served[0] == 200 and not any(task.done() for task in lints)
    finally:
        release.set()
    for task in lints:
        response = await task
        assert response.status == 200, await response.text()


async def test_one_tenant_holds_at_most_its_share_of_the_gateway(
    aiohttp_client, sqlite_url, tmp_path, worker_url
):
    """A tenant without max_concurrent_requests could hold every one of max_in_flight (streams an
    upstream never ends, say) and every other tenant got 503; it now gets 429 past half of them."""
    from gateway.state import ADMISSION

    app = create_app(make_config(sqlite_url, tmp_path, worker_urls=(worker_url,), max_in_flight=4))
    client = await aiohttp_client(app)
    hog, other = await new_tenant(client, name="hog"), await new_tenant(client, name="other")
    gate = app[ADMISSION]
    gate.enter("someone-else", None)  # a request of a third tenant, in flight throughout
    results = await burst(client, hog, 6, max_tokens=64, ignore_eos=True)
    statuses = sorted(status for status, _, _ in results)
    assert statuses.count(200) >= 2 and 503 not in statuses, statuses
    refused = [b for s, _, b in results if s == 429]
    assert refused and all(b["error"]["code"] == "concurrency_limit_exceeded" for b in refused)
    assert "limit of 2 concurrent requests" in refused[0]["error"]["message"]
    status, _, _ = await post(client, other, chat(max_tokens=1))
    assert status == 200
    gate.leave("someone-else")
