"""A stream cut for not being read counts what was generated against tokens per minute, not what the
client took (billing still counts only what it took, docs/api.md).

Before, the window of a stalled stream was settled down to the tokens delivered: the worker (or the
upstream) had generated more, into the buffers the client never emptied, so a tenant holding many
stalled streams used far more tokens per minute than its limit. Here a raw socket that never reads is
cut; the window must then hold more than the prompt + the completion tokens its record bills (at least
the tokens of the chunk whose write the client blocked). Both paths: the bundled worker's and an
external upstream's (with per-chunk usage, as vLLM's ``continuous_usage_stats``).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from gateway.ratelimit import tokens_key
from gateway.state import RATE_LIMITER
from tests.gateway.conftest import create_tenant
from tests.gateway.test_gateway_billing import wait_records
from tests.gateway.test_gateway_stalled_stream import (
    BIG_STREAM,
    BOUND_S,
    cutting_gateway,
    silent_client,
    wait_for,
)
from tests.gateway.test_gateway_upstream_openai import PUBLIC_MODEL, front_app, messages
from tests.gateway.test_gateway_upstream_openai_faults import sse_chunk

WRITE_TIMEOUT_S = 1.0
LIMIT = 1_000_000
UPSTREAM_PROMPT_TOKENS = 7


async def window_used(gateway, tenant_id: str) -> int:
    decision = await gateway.app[RATE_LIMITER].check(tokens_key(tenant_id), LIMIT, 0)
    return LIMIT - decision.remaining


async def settled_window(gateway, tenant_id: str, counted: int) -> int:
    """The window once the cut request's correction landed (it runs after the record is written)."""
    used = counted
    for _ in range(int(BOUND_S / 0.05)):
        used = await window_used(gateway, tenant_id)
        if used != counted:
            break
        await asyncio.sleep(0.05)
    return used


async def test_a_stalled_worker_stream_counts_what_the_worker_generated(
    aiohttp_client, sqlite_url, tmp_path, worker_url
):
    gateway, tenant = await cutting_gateway(
        aiohttp_client, sqlite_url, tmp_path, worker_url, rate_limit_tpm=LIMIT
    )
    body = BIG_STREAM  # the client's buffers fill while the worker keeps generating
    async with silent_client(gateway, "/v1/completions", tenant["api_key"], body):
        rows = await wait_records(gateway, 1, BOUND_S)
        assert len(rows) == 1
        counted = rows[0].prompt_tokens + 8 * 2000
        used = await settled_window(gateway, tenant["id"], counted)
    billed = rows[0].prompt_tokens + rows[0].completion_tokens
    assert rows[0].completion_tokens > 0
    assert billed < used <= counted, f"window {used}, billed {billed}, counted {counted}"


def usage_reporting_upstream(closed: asyncio.Event) -> web.Application:
    """An upstream streaming large chunks, each with the usage so far, until its client goes away."""

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for index in range(1_000_000):
                usage = {"prompt_tokens": UPSTREAM_PROMPT_TOKENS, "completion_tokens": index + 1}
                await response.write(sse_chunk("x" * 1024, usage=usage))
        except (ConnectionError, asyncio.CancelledError):
            closed.set()
            raise
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def test_a_stalled_upstream_stream_counts_what_the_upstream_generated(
    aiohttp_client, aiohttp_server, sqlite_template, tmp_path
):
    closed = asyncio.Event()
    server = await aiohttp_server(usage_reporting_upstream(closed))
    url = str(server.make_url("/v1"))
    app = front_app(
        sqlite_template,
        tmp_path / "front",
        url,
        api_key="k",
        stream_write_timeout_s=WRITE_TIMEOUT_S,
        default_max_tokens=4,  # the check reserves 4: the upstream's usage decides the rest
    )
    front = await aiohttp_client(app)
    tenant = await create_tenant(front, rate_limit_tpm=LIMIT)
    body = {"model": PUBLIC_MODEL, "messages": messages("x"), "stream": True}
    async with silent_client(front, "/v1/chat/completions", tenant["api_key"], body):
        assert await wait_for(lambda: closed.is_set())
        rows = await wait_records(front, 1, BOUND_S)
        assert len(rows) == 1
        used = await window_used(front, tenant["id"])  # settled inside the handler, before the record
    billed = rows[0].prompt_tokens + rows[0].completion_tokens
    assert rows[0].prompt_tokens == UPSTREAM_PROMPT_TOKENS
    assert rows[0].completion_tokens > 4
    assert used > billed, f"window {used}, billed {billed}"
