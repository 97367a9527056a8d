"""A client that keeps reading, however slowly, is never cut (review r8 #3).

``stream_write_timeout_s`` used to bound each write. A write that finds the buffers full waits until
aiohttp's buffer drains from its high to its low water mark (~48 KiB), so the rule really was "cut any
client slower than ~48 KiB per timeout", although it never stopped reading. The deadline now runs from
the last byte that left: here a raw socket reads 4 KiB every 0.2 s (~20 KB/s, far below 48 KiB per
second) for 8 x the timeout and must not be cut; a client that stops reading still is
(tests/gateway/test_gateway_stalled_stream.py).
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from tests.gateway.conftest import create_tenant
from tests.gateway.test_gateway_billing import records
from tests.gateway.test_gateway_stalled_stream import silent_client
from tests.gateway.test_gateway_upstream_openai import PUBLIC_MODEL, front_app, messages
from tests.gateway.test_gateway_upstream_openai_faults import sse_chunk

WRITE_TIMEOUT_S = 1.0
READ_FOR_S = 8.0  # 8 x the write timeout
READ_EVERY_S = 0.2  # 5 x within each timeout: generous under load


def long_upstream() -> web.Application:
    """An upstream streaming ~20 MB: far more than the slow reader takes in ``READ_FOR_S``."""

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(20_000):
            await response.write(sse_chunk("x" * 1024))
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def test_a_client_that_keeps_reading_slowly_is_not_cut(
    aiohttp_client, aiohttp_server, sqlite_template, tmp_path
):
    server = await aiohttp_server(long_upstream())
    url = str(server.make_url("/v1"))
    app = front_app(
        sqlite_template, tmp_path / "front", url, api_key="k", stream_write_timeout_s=WRITE_TIMEOUT_S
    )
    front = await aiohttp_client(app)
    tenant = await create_tenant(front)
    body = {"model": PUBLIC_MODEL, "messages": messages("x"), "stream": True}
    loop = asyncio.get_running_loop()
    async with silent_client(front, "/v1/chat/completions", tenant["api_key"], body) as sock:
        num_received, cut_after_s = 0, None
        started = time.monotonic()
        while time.monotonic() - started < READ_FOR_S:
            await asyncio.sleep(READ_EVERY_S)
            try:
                data = await asyncio.wait_for(loop.sock_recv(sock, 4096), WRITE_TIMEOUT_S)
            except (ConnectionError, TimeoutError):
                data = b""
            if not data:
                cut_after_s = time.monotonic() - started
                break
            num_received += len(data)
        rows = await records(front)
    assert cut_after_s is None, f"cut after {cut_after_s:.1f} s and {num_received} bytes while reading"
    assert rows == []  # still streaming: nothing recorded, in particular no 499
    assert num_received > READ_FOR_S / READ_EVERY_S / 2 * 1024  # it did read, slowly
