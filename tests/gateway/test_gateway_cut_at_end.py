"""A stream cut at its very end is billed only what left the gateway, and is not a server error
(review r11 #1).

The writes after the last chunk (the usage chunk, ``[DONE]``, the end) were outside the cut's handler:
a client that stopped reading there was billed every token, including those whose bytes sat in
aiohttp's buffer that the cut's abort threw away, and the ``StalledClient`` escaped as aiohttp's
"Error handling request". Which write a silent client's full buffers block depends on the machine's
socket buffers, so each test first measures what a silent client holds (a long stream, cut), then
sweeps the length of the answer from about there until a stream is cut in its middle: the lengths
in between end their answer while the buffers fill. Every one must be billed at most what its client
received, with no ERROR logged.
"""

from __future__ import annotations

import logging

import orjson
from aiohttp import web

from gateway.app import create_app
from tenancy.usage_types import OUTCOME_CANCELLED_ESTIMATED, OUTCOME_COMPLETED
from tests.gateway.conftest import create_tenant, make_config
from tests.gateway.test_gateway_billing import wait_records
from tests.gateway.test_gateway_cut_billing import read_to_end, received_chunks
from tests.gateway.test_gateway_stalled_stream import BOUND_S, silent_client
from tests.gateway.test_gateway_upstream_openai import PUBLIC_MODEL, front_app
from tests.gateway.test_gateway_upstream_openai_faults import sse_chunk

WRITE_TIMEOUT_S = 0.5
CHUNK_BYTES = 20000  # few chunks fill the buffers: each step of the sweep moves the end by one chunk
MAX_STEPS = 14
NUM_CHOICES = 8


def finite_upstream() -> web.Application:
    """Streams ``num`` chunks of ``CHUNK_BYTES`` (the last message's content), its usage, [DONE]."""

    async def chat(request: web.Request) -> web.StreamResponse:
        num = int((await request.json())["messages"][-1]["content"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(num):
            await response.write(sse_chunk("x" * CHUNK_BYTES))
        usage = {"prompt_tokens": 3, "completion_tokens": num, "total_tokens": num + 3}
        final = {"id": "up", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": []}
        await response.write(b"data: " + orjson.dumps({**final, "usage": usage}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


def server_errors(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]


async def test_an_upstream_stream_cut_at_its_end_bills_only_what_was_received(
    aiohttp_client, aiohttp_server, sqlite_template, tmp_path, caplog
):
    server = await aiohttp_server(finite_upstream())
    url = str(server.make_url("/v1"))
    app = front_app(
        sqlite_template, tmp_path / "front", url, api_key="k", stream_write_timeout_s=WRITE_TIMEOUT_S
    )
    front = await aiohttp_client(app)
    tenant = await create_tenant(front)
    done = 0

    async def cut(num: int) -> tuple[str, int, int]:
        nonlocal done
        body = {"model": PUBLIC_MODEL, "messages": [{"role": "user", "content": str(num)}], "stream": True}
        async with silent_client(front, "/v1/chat/completions", tenant["api_key"], body) as sock:
            done += 1
            rows = await wait_records(front, done, BOUND_S)
            raw = await read_to_end(sock, 3.0)
        row = max(rows, key=lambda r: r.id)
        received = sum(1 for c in received_chunks(raw) for choice in c["choices"] if choice["delta"])
        return row.outcome, row.completion_tokens, received

    _, _, held = await cut(400)  # what a silent client's buffers hold
    seen = []
    for num in range(max(1, held - 2), held - 2 + MAX_STEPS):
        outcome, billed, received = await cut(num)
        seen.append((num, outcome, billed, received))
        if outcome == OUTCOME_CANCELLED_ESTIMATED:  # cut in the middle: past the end's window
            break
    over = [step for step in seen if step[2] > step[3]]
    assert not over and not server_errors(caplog), f"billed > received: {over}; {server_errors(caplog)}"
    outcomes = [step[1] for step in seen]
    assert outcomes[0] == OUTCOME_COMPLETED and outcomes[-1] == OUTCOME_CANCELLED_ESTIMATED, seen


async def test_a_worker_stream_cut_at_its_end_bills_only_what_was_received(
    aiohttp_client, sqlite_url, tmp_path, worker_url, caplog
):
    config = make_config(
        sqlite_url, tmp_path, worker_urls=(worker_url,), stream_write_timeout_s=WRITE_TIMEOUT_S
    )
    gateway = await aiohttp_client(create_app(config))
    tenant = await create_tenant(gateway)
    done = 0

    async def cut(max_tokens: int) -> tuple[int, int]:
        nonlocal done
        body = {
            "model": "random-tiny",
            "prompt": "hello",
            "stream": True,
            "max_tokens": max_tokens,
            "n": NUM_CHOICES,
            "ignore_eos": True,
            "logprobs": 5,  # large chunks: the buffers hold few tokens
        }
        async with silent_client(gateway, "/v1/completions", tenant["api_key"], body) as sock:
            done += 1
            rows = await wait_records(gateway, done, BOUND_S)
            raw = await read_to_end(sock, 3.0)
        received = sum(
            len((choice.get("logprobs") or {}).get("tokens") or [])
            for chunk in received_chunks(raw)
            for choice in chunk.get("choices", [])
        )
        return max(rows, key=lambda r: r.id).completion_tokens, received

    _, held = await cut(2000)  # what a silent client's buffers hold
    seen = []
    # Measured here (review r11): held 6805 tokens, the end's window at max_tokens 870-874 (+20..+24).
    for max_tokens in range(held // NUM_CHOICES + 12, held // NUM_CHOICES + 33, 3):
        billed, received = await cut(max_tokens)
        seen.append((max_tokens, billed, received))
    over = [step for step in seen if step[1] > step[2]]
    assert not over and not server_errors(caplog), f"billed > received: {over}; {server_errors(caplog)}"
    assert seen[0][1] == seen[0][2] == seen[0][0] * NUM_CHOICES, f"the sweep starts past the end: {seen}"
    assert seen[-1][2] < seen[-1][0] * NUM_CHOICES, f"the sweep ends before the buffers fill: {seen}"
