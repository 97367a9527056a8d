"""Hostile answers from an external upstream: a body that is not JSON, one too large to buffer, an SSE
stream without ``data:`` lines or with a line too long to read, chunks whose ``choices`` are not a list
of objects, and usage that cannot be true (``cached_tokens`` above the prompt, negative counts). The
gateway never crashes, never bills nonsense (it clamps and logs), and answers a clear 502.

SCRIPTED far side: no real server sends these on demand, so a small aiohttp app plays a misbehaving
upstream. The front gateway, its database and the openai SDK are real.
"""

from __future__ import annotations

import openai
import orjson
import pytest
from aiohttp import web

from gateway import upstream_openai
from tests.gateway.test_gateway_billing import wait_records
from tests.gateway.test_gateway_upstream_openai import PUBLIC_MODEL, messages
from tests.gateway.test_gateway_upstream_openai_faults import front_sdk, sse_chunk

ANSWER = {
    "id": "up-1",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
}
HUGE_BYTES = 40 << 20  # a valid JSON answer over the gateway's MAX_ANSWER_BYTES
NONSENSE_USAGE = {
    "prompt_tokens": 10,
    "completion_tokens": -4,
    "prompt_tokens_details": {"cached_tokens": 64},
}


def hostile_server(mode: str) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if mode == "not_json":
            return web.Response(text="<html>502 Bad Gateway (nginx)</html>", content_type="text/html")
        if mode == "json_list":
            return web.json_response([1, 2, 3])
        if mode == "huge":
            content = "x" * HUGE_BYTES
            return web.json_response({**ANSWER, "choices": [{"message": {"content": content}}]})
        if mode == "nonsense_usage" and not body.get("stream"):
            return web.json_response({**ANSWER, "usage": NONSENSE_USAGE})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if mode == "no_data_lines":  # JSON lines with no SSE framing (an NDJSON server)
            await response.write(orjson.dumps({"choices": [{"delta": {"content": "a"}}]}) + b"\n")
            await response.write(b"event: message\n\n")
        elif mode == "long_line":
            await response.write(b"data: " + b"x" * (1 << 20) + b"\n\n")
        elif mode == "bad_choices":
            await response.write(sse_chunk("Hel"))
            await response.write(b"data: " + orjson.dumps({"choices": "everything"}) + b"\n\n")
        elif mode == "nonsense_usage":
            await response.write(sse_chunk("Hel"))
            usage_only = {
                "id": "up-1",
                "object": "chat.completion.chunk",
                "choices": [],
                "usage": NONSENSE_USAGE,
            }
            await response.write(b"data: " + orjson.dumps(usage_only) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def _front(aiohttp_client, aiohttp_server, sqlite_template, tmp_path, mode: str):
    upstream = hostile_server(mode)
    return await front_sdk(
        aiohttp_client, aiohttp_server, sqlite_template, tmp_path, upstream, flavour="none"
    )


@pytest.mark.parametrize("mode", ["not_json", "json_list", "huge"])
async def test_an_unusable_answer_is_a_502_and_bills_nothing(
    aiohttp_client, aiohttp_server, sqlite_template, tmp_path, mode
):
    assert upstream_openai.MAX_ANSWER_BYTES < HUGE_BYTES
    client, sdk = await _front(aiohttp_client, aiohttp_server, sqlite_template, tmp_path, mode)
    with pytest.raises(openai.APIStatusError) as caught:
        await sdk.chat.completions.create(model=PUBLIC_MODEL, messages=messages("x"))
    await sdk.close()
    assert caught.value.status_code == 502, caught.value.body
    assert caught.value.body["code"] == "upstream_error" and "pg-upstream" in caught.value.body["message"]
    rows = await wait_records(client, 1)
    assert [(r.status, r.outcome, r.prompt_tokens, r.cost_total) for r in rows] == [
        (502, "server_error", 0, 0)
    ]


@pytest.mark.parametrize("mode", ["no_data_lines", "long_line"])
async def test_a_stream_with_nothing_readable_is_a_502(
    aiohttp_client, aiohttp_server, sqlite_template, tmp_path, mode
):
    client, sdk = await _front(aiohttp_client, aiohttp_server, sqlite_template, tmp_path, mode)
    with pytest.raises(openai.APIStatusError) as caught:
        stream = await sdk.chat.completions.create(model=PUBLIC_MODEL, messages=messages("x"), stream=True)
        [chunk async for chunk in stream]
    await sdk.close()
    assert caught.value.status_code == 502 and caught.value.body["code"] == "upstream_error", (
        caught.value.body
    )
    rows = await wait_records(client, 1)
    assert [(r.status, r.prompt_tokens) for r in rows] == [(502, 0)]


async def test_malformed_choices_mid_stream_end_it_with_an_error_event(
    aiohttp_client, aiohttp_server, sqlite_template, tmp_path
):
    client, sdk = await _front(aiohttp_client, aiohttp_server, sqlite_template, tmp_path, "bad_choices")
    stream = await sdk.chat.completions.create(model=PUBLIC_MODEL, messages=messages("x"), stream=True)
    received = []
    with pytest.raises(openai.APIError) as caught:
        async for chunk in stream:
            received.append(chunk.choices[0].delta.content)
    await sdk.close()
    assert received == ["Hel"] and "malformed stream chunk" in caught.value.message
    rows = await wait_records(client, 1)
    assert [(r.status, r.outcome) for r in rows] == [(200, "server_error")]


async def test_usage_that_cannot_be_true_is_clamped(
    aiohttp_client, aiohttp_server, sqlite_template, tmp_path
):
    """cached_tokens 64 of a 10-token prompt and -4 completion tokens: billed 10 cached, 0 completion."""
    client, sdk = await _front(aiohttp_client, aiohttp_server, sqlite_template, tmp_path, "nonsense_usage")
    reply = await sdk.chat.completions.create(model=PUBLIC_MODEL, messages=messages("x"))
    stream = await sdk.chat.completions.create(
        model=PUBLIC_MODEL, messages=messages("x"), stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    await sdk.close()
    for usage in (reply.usage, chunks[-1].usage):
        assert (usage.prompt_tokens, usage.completion_tokens) == (10, 0)
        assert usage.prompt_tokens_details.cached_tokens == 10
    rows = await wait_records(client, 2)
    assert [(r.outcome, r.prompt_tokens, r.cached_tokens, r.completion_tokens) for r in rows] == [
        ("completed", 10, 10, 0)
    ] * 2
    assert all(r.cost_total >= 0 for r in rows)
