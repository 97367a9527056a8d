"""Upstream behaviours the real servers in the other upstream tests do not show on demand, from a small
scripted HTTP server: a stream that fails after its first chunk (vLLM's in-stream error event, a dropped
connection) and a server that reports no usage at all (older llama.cpp streams). The front gateway,
its database and the openai SDK are real; only the far side is scripted."""

from __future__ import annotations

import asyncio

import openai
import orjson
import pytest
from aiohttp import web
from openai import AsyncOpenAI

from tests.gateway.conftest import create_tenant
from tests.gateway.test_gateway_billing import wait_records
from tests.gateway.test_gateway_upstream_openai import PUBLIC_MODEL, front_app, messages


def sse_chunk(content: str, **extra) -> bytes:
    """One ``chat.completion.chunk`` SSE event carrying ``content``."""
    body = {
        "id": "up-1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
        **extra,
    }
    return b"data: " + orjson.dumps(body) + b"\n\n"


def scripted_server(mode: str) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):  # no usage in a non-streamed answer either
            answer = {
                "id": "up-1",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
                ],
            }
            return web.json_response(answer)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(sse_chunk("Hel"))
        await asyncio.sleep(0.05)
        if mode == "error_event":
            error = {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
            await response.write(b"data: " + orjson.dumps(error) + b"\n\n")
        elif mode == "drop":
            assert request.transport is not None
            request.transport.close()
            return response
        else:  # "no_usage": a whole stream, no usage anywhere
            await response.write(sse_chunk("lo"))
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def front_sdk(
    aiohttp_client, aiohttp_server, sqlite_template, tmp_path, upstream: web.Application, **front
):
    """A front gateway whose ``openai`` upstream is ``upstream`` (``front`` goes to ``front_app``), and the
    SDK as a tenant of it."""
    server = await aiohttp_server(upstream)
    app = front_app(sqlite_template, tmp_path / "front", str(server.make_url("/v1")), api_key="k", **front)
    client = await aiohttp_client(app)
    key = (await create_tenant(client, name="acme"))["api_key"]
    return client, AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0)


async def _front_sdk(aiohttp_client, aiohttp_server, sqlite_template, tmp_path, mode: str):
    return await front_sdk(aiohttp_client, aiohttp_server, sqlite_template, tmp_path, scripted_server(mode))


@pytest.mark.parametrize("mode", ["error_event", "drop"])
async def test_a_stream_failing_after_its_first_chunk_ends_with_an_error_event(
    aiohttp_client, aiohttp_server, sqlite_template, tmp_path, mode
):
    client, sdk = await _front_sdk(aiohttp_client, aiohttp_server, sqlite_template, tmp_path, mode)
    stream = await sdk.chat.completions.create(model=PUBLIC_MODEL, messages=messages("x"), stream=True)
    received = []
    with pytest.raises(openai.APIError) as caught:
        async for chunk in stream:
            received.append(chunk.choices[0].delta.content)
    await sdk.close()
    assert received == ["Hel"]
    assert "upstream 'pg-upstream'" in caught.value.message
    rows = await wait_records(client, 1)
    assert [(r.status, r.outcome) for r in rows] == [(200, "server_error")]


async def test_an_upstream_without_usage_is_recorded_as_unreported(
    aiohttp_client, aiohttp_server, sqlite_template, tmp_path
):
    client, sdk = await _front_sdk(aiohttp_client, aiohttp_server, sqlite_template, tmp_path, "no_usage")
    stream = await sdk.chat.completions.create(
        model=PUBLIC_MODEL, messages=messages("x"), stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    reply = await sdk.chat.completions.create(model=PUBLIC_MODEL, messages=messages("x"))
    await sdk.close()
    assert "".join(c.choices[0].delta.content for c in chunks) == "Hello"
    assert all(c.usage is None for c in chunks)  # no usage chunk made up
    assert reply.choices[0].message.content == "hi" and reply.usage is None
    rows = await wait_records(client, 2)
    assert [(r.outcome, r.prompt_tokens, r.completion_tokens, r.cost_total) for r in rows] == [
        ("usage_unreported", 0, 0, 0.0)
    ] * 2
