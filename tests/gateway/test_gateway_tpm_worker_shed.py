"""The tokens-per-minute window keeps nothing of a request no worker started (r18): a worker whose queue
is full sheds it (503 + Retry-After: ``WorkerNotStarted``), nothing ran and nothing is billed, so the
prompt goes back to the window too; otherwise a tenant whose requests are shed while other tenants fill
the pool is refused by its own limit for work that never ran. Real gateway and worker, behind a front
that sheds ``/v1/generate`` as worker/server.py does when overloaded."""

from __future__ import annotations

import aiohttp
import openai
import pytest
from aiohttp import web

from gateway.app import create_app
from tests.gateway.conftest import make_config
from tests.gateway.test_gateway_ratelimit_n import MODEL, in_one_window, tenant_sdk

LIMIT = 1000
MESSAGES = [{"role": "user", "content": "x" * 280}]  # ~300 prompt tokens with the byte tokenizer


def shedding_worker(worker_url: str) -> web.Application:
    session: aiohttp.ClientSession | None = None
    state = {"shed": True}

    async def relay(request: web.Request) -> web.Response:
        nonlocal session
        session = session or aiohttp.ClientSession()
        async with session.request(
            request.method,
            worker_url + request.path_qs,
            data=await request.read(),
            headers={"Content-Type": "application/json"},
        ) as answer:
            return web.Response(
                body=await answer.read(), status=answer.status, content_type="application/json"
            )

    async def generate(request: web.Request) -> web.StreamResponse:
        if not state["shed"]:
            return await relay(request)
        await request.read()
        return web.json_response(
            {"error": {"message": "worker queue is full", "type": "overloaded", "code": "overloaded"}},
            status=503,
            headers={"Retry-After": "1"},
        )

    async def close(app: web.Application) -> None:
        if session is not None:
            await session.close()

    app = web.Application()
    app.state = state
    app.router.add_post("/v1/generate", generate)
    app.router.add_route("*", "/{tail:.*}", relay)
    app.on_cleanup.append(close)
    return app


async def test_shed_requests_do_not_fill_the_token_window(
    aiohttp_client, aiohttp_server, sqlite_url, tmp_path, worker_url
):
    front_app = shedding_worker(worker_url)
    front = await aiohttp_server(front_app)
    gateway = await aiohttp_client(
        create_app(make_config(sqlite_url, tmp_path, worker_urls=(str(front.make_url("")).rstrip("/"),)))
    )
    sdk = await tenant_sdk(gateway, rate_limit_tpm=LIMIT)
    await in_one_window()
    statuses = []
    for _ in range(4):  # shed by the worker: nothing ran, nothing billed
        with pytest.raises(openai.APIStatusError) as shed:
            await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
        statuses.append(
            (
                shed.value.status_code,
                shed.value.body.get("message") if isinstance(shed.value.body, dict) else shed.value.body,
            )
        )
    # Each is the worker's shedding passed on, never the tenant's own TPM limit.
    assert [status for status, _ in statuses] == [503] * 4, statuses
    front_app.state["shed"] = False  # the pool recovers
    try:
        raw = await sdk.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=1
        )
    except openai.RateLimitError as exc:
        pytest.fail(f"the tenant's first request that runs is refused by its own TPM window: {exc}")
    usage = raw.parse().usage
    left = int(raw.headers["x-ratelimit-remaining-tokens"])
    assert left == LIMIT - (usage.prompt_tokens + 1), (
        f"{LIMIT - 1 - usage.prompt_tokens - left} tokens of shed requests counted"
    )
    await sdk.close()
