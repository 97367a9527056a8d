"""The tokens-per-minute window on the bundled-worker path counts prompt + n × max_tokens when the request
is checked, then is corrected to what the worker did (prompt + completion tokens) once the answer is
known: a plain answer, a stream, a stream its client cut, a request that failed. Before, it kept the
max_tokens estimate, so a tenant limited to 1,000 tokens per minute sending answers of a token or two
with ``max_tokens=300`` was refused at its fourth request.

Real gateway, real worker process, real Redis for the shared window, the openai SDK. The answers are made
short by a logit bias on the end-of-turn token (id 257 of the byte tokenizer), not by luck.
"""

from __future__ import annotations

import aiohttp
import openai
import pytest
from aiohttp import web

from gateway.app import create_app
from tests.gateway.conftest import make_config
from tests.gateway.test_gateway_ratelimit_n import MESSAGES, MODEL, in_one_window, limited_gateway, tenant_sdk

__all__ = ["limited_gateway"]  # the fixture, re-exported for pytest

LIMIT = 1000
MAX_TOKENS = 300
SHORT = {"logit_bias": {"257": 100}}  # <|end|> first: answers of one token or none


def remaining(raw) -> int:
    return int(raw.headers["x-ratelimit-remaining-tokens"])


async def test_short_answers_give_back_what_they_did_not_use(limited_gateway):
    sdk = await tenant_sdk(limited_gateway, rate_limit_tpm=LIMIT)
    await in_one_window()
    served = []
    for _ in range(8):  # 8 × (prompt + 300) is twice the limit; 8 × (prompt + 1) is far under it
        raw = await sdk.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, **SHORT
        )
        served.append((remaining(raw), raw.parse().usage))
    (first_left, first), (second_left, _) = served[0], served[1]
    assert first.completion_tokens <= 1, first
    counted = first.prompt_tokens + MAX_TOKENS
    assert first_left == LIMIT - counted
    # The second request's check saw the first settled to what it used.
    assert second_left == LIMIT - (first.prompt_tokens + first.completion_tokens) - counted


async def test_streams_and_cut_streams_give_back_what_they_did_not_use(limited_gateway):
    sdk = await tenant_sdk(limited_gateway, rate_limit_tpm=LIMIT)
    await in_one_window()
    for _ in range(4):  # whole streams
        stream = await sdk.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, stream=True, **SHORT
        )
        assert [chunk async for chunk in stream]
    for _ in range(4):  # cut after the first chunk: the client hangs up
        stream = await sdk.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, stream=True
        )
        async for _chunk in stream:
            break
        await stream.close()
    raw = await sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, **SHORT
    )
    assert remaining(raw) >= 0


def failing_worker(worker_url: str) -> web.Application:
    """A front for the real worker that passes everything through but ``/v1/generate``, which it answers
    with a 500: a request that fails on the worker after the gateway's check."""
    session: aiohttp.ClientSession | None = None

    async def relay(request: web.Request) -> web.Response:
        nonlocal session
        session = session or aiohttp.ClientSession()
        async with session.get(worker_url + request.path_qs) as answer:
            return web.Response(
                body=await answer.read(), status=answer.status, content_type="application/json"
            )

    async def generate(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"error": {"message": "engine error", "type": "server_error"}}, status=500)

    async def close(app: web.Application) -> None:
        if session is not None:
            await session.close()

    app = web.Application()
    app.router.add_post("/v1/generate", generate)
    app.router.add_get("/{tail:.*}", relay)
    app.on_cleanup.append(close)
    return app


async def test_a_failed_request_gives_back_its_completion_estimate(
    aiohttp_client, aiohttp_server, sqlite_url, tmp_path, worker_url
):
    """A request the worker fails (500) generated nothing: its max_tokens are given back. Before, six
    such requests of 324 counted tokens each were 429 from the fourth on."""
    front = await aiohttp_server(failing_worker(worker_url))
    worker = str(front.make_url("")).rstrip("/")
    gateway = await aiohttp_client(create_app(make_config(sqlite_url, tmp_path, worker_urls=(worker,))))
    sdk = await tenant_sdk(gateway, rate_limit_tpm=LIMIT)
    for _ in range(6):
        with pytest.raises(openai.InternalServerError) as failed:
            await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS)
        assert failed.value.status_code == 502
