"""The tokens-per-minute window of a request that did not complete counts what the workers generated as
the gateway received it, within what the request allowed (review r20):

1. a stalled ``n`` > 1 stream: the choices' events wait in the gateway's queue while the client reads
   nothing; they were counted only when the writer took them, so the cut refunded what was queued;
2. an external upstream that sends more chunks than ``n`` × ``max_tokens`` (it ignores the bound, or
   splits tokens): each chunk was counted as a token, unclamped, charging the tenant for tokens its
   request could never have caused;
3. a non-streamed ``n`` > 1 answer whose client hung up mid-generation: settled to the prompt alone,
   so hanging up just before the end generated without limit.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from gateway.app import create_app
from tests.gateway.conftest import create_tenant, make_config
from tests.gateway.test_gateway_billing import wait_records
from tests.gateway.test_gateway_stalled_stream import BOUND_S, silent_client, worker_busy
from tests.gateway.test_gateway_tpm_stalled import LIMIT, window_used
from tests.gateway.test_gateway_upstream_openai import PUBLIC_MODEL, front_app, messages
from tests.gateway.test_gateway_upstream_openai_faults import sse_chunk


async def until_worker_idle(worker_url: str) -> None:
    for _ in range(600):
        if await worker_busy(worker_url) == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the worker should have finished before the cut")


async def test_a_stalled_n_stream_counts_the_tokens_queued_in_the_gateway(
    aiohttp_client, sqlite_url, tmp_path, worker_url
):
    n, max_tokens = 8, 1000
    config = make_config(sqlite_url, tmp_path, worker_urls=(worker_url,), stream_write_timeout_s=20.0)
    gateway = await aiohttp_client(create_app(config))
    tenant = await create_tenant(gateway, rate_limit_tpm=LIMIT)
    body = {
        "model": "random-tiny",
        "prompt": "hello",
        "stream": True,
        "max_tokens": max_tokens,
        "n": n,
        "ignore_eos": True,
        "logprobs": 5,  # large chunks: the client's window fills long before the answer ends
    }
    async with silent_client(gateway, "/v1/completions", tenant["api_key"], body):
        for _ in range(100):  # started
            if await window_used(gateway, tenant["id"]) > 0:
                break
            await asyncio.sleep(0.05)
        await until_worker_idle(worker_url)  # every token generated, most queued in the gateway
        rows = await wait_records(gateway, 1, BOUND_S)  # the write timeout cuts the stream
        await asyncio.sleep(2.0)  # the correction runs right after the record
        used = await window_used(gateway, tenant["id"])
    assert len(rows) == 1 and rows[0].completion_tokens < n * max_tokens  # cut: billed what was delivered
    assert used == rows[0].prompt_tokens + n * max_tokens


def chatty_upstream(num_chunks: int) -> web.Application:
    """Streams ``num_chunks`` one-character chunks (no usage), then fails with an error event."""

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(num_chunks):
            await response.write(sse_chunk("x"))
        await response.write(b'data: {"error": {"message": "engine died"}}\n\n')
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def test_upstream_chunks_past_max_tokens_do_not_charge_the_tenant_window(
    aiohttp_client, aiohttp_server, sqlite_template, tmp_path
):
    server = await aiohttp_server(chatty_upstream(400))
    app = front_app(sqlite_template, tmp_path / "front", str(server.make_url("/v1")), api_key="k")
    front = await aiohttp_client(app)
    tenant = await create_tenant(front, rate_limit_tpm=1_000_000)
    body = {"model": PUBLIC_MODEL, "messages": messages("x"), "stream": True, "max_tokens": 5}
    response = await front.post(
        "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {tenant['api_key']}"}
    )
    assert "engine died" in await response.text()
    await wait_records(front, 1)
    await asyncio.sleep(0.5)
    used = await window_used(front, tenant["id"])
    prompt_estimate = len(str(messages("x"))) // 4 + 50  # chars / 4, with room: far below 400
    assert 5 <= used <= 5 + prompt_estimate


async def test_a_hung_up_non_streamed_n_request_keeps_its_count(
    aiohttp_client, sqlite_url, tmp_path, worker_url
):
    n, max_tokens = 4, 4000
    gateway = await aiohttp_client(create_app(make_config(sqlite_url, tmp_path, worker_urls=(worker_url,))))
    tenant = await create_tenant(gateway, rate_limit_tpm=LIMIT)
    body = {"model": "random-tiny", "prompt": "hello", "max_tokens": max_tokens, "n": n, "ignore_eos": True}
    async with silent_client(gateway, "/v1/completions", tenant["api_key"], body):
        for _ in range(100):  # the worker is generating the request's choices
            if await worker_busy(worker_url) >= n:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # tokens generated and received by the gateway
        assert await worker_busy(worker_url) >= 1, "still generating when the client hangs up"
        counted = await window_used(gateway, tenant["id"])  # the check's: prompt + n × max_tokens
    rows = await wait_records(gateway, 1, 30.0)
    assert len(rows) == 1 and rows[0].outcome == "client_cancelled"
    await asyncio.sleep(1.0)  # the correction's own task
    assert await window_used(gateway, tenant["id"]) == counted
