"""A streamed upstream answer whose client hangs up while the gateway settles its tokens-per-minute window
(after the last chunk, before the usage chunk) is still settled: the correction runs in its own task, so
the handler's cancellation (handler_cancellation=True in production, gateway/up.py) does not interrupt
it (review r13 #2: before, the tenant kept the chars/4 estimate in its window, not the upstream's count).

The limiter's charge is wrapped only to hold the (normally ~1 ms Redis) window open long enough for the
client to hang up in it; it then calls the real charge."""

import asyncio

import orjson
import pytest
from aiohttp import web

from gateway.state import RATE_LIMITER
from tests.gateway.conftest import create_tenant
from tests.gateway.test_gateway_upstream_openai import PUBLIC_MODEL, front_app
from tests.gateway.test_gateway_upstream_openai_faults import sse_chunk

PROMPT_TOKENS = 5000  # the upstream counts far more than the estimate: the window must be charged


def upstream() -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(sse_chunk("hello"))
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 1, "total_tokens": PROMPT_TOKENS + 1}
        final = {"id": "up", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": []}
        await response.write(b"data: " + orjson.dumps({**final, "usage": usage}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


@pytest.mark.parametrize("hang_up", [False, True])
async def test_a_hang_up_during_settlement_still_settles_the_window(
    aiohttp_client, aiohttp_server, sqlite_template, tmp_path, hang_up
):
    server = await aiohttp_server(upstream())
    app = front_app(sqlite_template, tmp_path / "front", str(server.make_url("/v1")), api_key="k")
    front = await aiohttp_client(app, server_kwargs={"handler_cancellation": True})
    tenant = await create_tenant(front, rate_limit_tpm=1_000_000)
    limiter = app[RATE_LIMITER]
    real_charge = limiter.charge
    entered, release = asyncio.Event(), asyncio.Event()
    landed: list[int] = []

    async def charge(key, cost):
        entered.set()
        await release.wait()  # widen the Redis round trip's window
        await real_charge(key, cost)
        landed.append(cost)

    limiter.charge = charge
    body = {"model": PUBLIC_MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    headers = {"Authorization": f"Bearer {tenant['api_key']}"}
    response = await front.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status == 200
    await asyncio.wait_for(entered.wait(), 10)  # the last chunk went out; the gateway settles now
    if hang_up:  # the control (False) settles: the charge lands
        response.close()  # the client hangs up before the usage chunk
    await asyncio.sleep(0.5)
    release.set()
    for _ in range(50):
        if landed:
            break
        await asyncio.sleep(0.1)
    assert landed and landed[0] > PROMPT_TOKENS // 2, f"the TPM window was never settled: {landed}"
