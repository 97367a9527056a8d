"""A streaming client that stops reading is cut after ``stream_write_timeout_s`` (review r6 #1).

Each SSE chunk is written with ``await response.write``; once the socket buffers are full, a client
that reads nothing blocks that write. Without a deadline the handler never ended: its ``n`` admission
slots were never given back and no usage record was written, long after the worker finished. Here a
raw socket with a 4 KiB receive buffer asks for a large stream and never reads: the gateway must cut it
(recorded as the client's cancellation, billed what reached the socket), free its slots and stop the
generation, while the socket is still open. Both paths: the bundled worker's and an external upstream's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from gateway.app import create_app
from gateway.state import ADMISSION
from tenancy.usage_types import OUTCOME_CANCELLED_ESTIMATED, OUTCOME_CLIENT_CANCELLED
from tests.gateway.conftest import create_tenant, make_config
from tests.gateway.test_gateway_billing import wait_records
from tests.gateway.test_gateway_upstream_openai import PUBLIC_MODEL, front_app, messages
from tests.gateway.test_gateway_upstream_openai_faults import sse_chunk

WRITE_TIMEOUT_S = 1.0
BOUND_S = 60.0  # generous under load: main held the slots for as long as the socket stayed open


@contextlib.asynccontextmanager
async def silent_client(client, path: str, key: str, body: dict) -> AsyncIterator[socket.socket]:
    """POST ``body`` on a raw socket that never reads its answer (closed on exit)."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    sock.setblocking(False)
    try:
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, (client.server.host, client.server.port))
        await loop.sock_sendall(sock, head + data)
        yield sock
    finally:
        sock.close()


async def wait_for(condition, timeout_s: float = BOUND_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


# n=8 choices of 2,000 tokens with logprobs: large chunks, so a client that reads nothing fills its
# buffers long before the answer ends (the cut, hang-up and tokens-per-minute tests share it).
BIG_STREAM = {
    "model": "random-tiny",
    "prompt": "hello",
    "stream": True,
    "n": 8,
    "max_tokens": 2000,
    "ignore_eos": True,
    "logprobs": 5,
}


async def cutting_gateway(aiohttp_client, sqlite_url, tmp_path, worker_url, **tenant_fields):
    """A gateway over the worker that cuts a stream after WRITE_TIMEOUT_S without progress, and a tenant."""
    config = make_config(
        sqlite_url, tmp_path, worker_urls=(worker_url,), stream_write_timeout_s=WRITE_TIMEOUT_S
    )
    gateway = await aiohttp_client(create_app(config))
    return gateway, await create_tenant(gateway, **tenant_fields)


async def worker_busy(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/stats") as response:
        stats = await response.json()
    return stats["num_running"] + stats.get("num_waiting", 0)


async def test_a_worker_stream_nobody_reads_is_cut_and_frees_its_slots(
    aiohttp_client, sqlite_url, tmp_path, worker_url
):
    gateway, tenant = await cutting_gateway(aiohttp_client, sqlite_url, tmp_path, worker_url)
    body = BIG_STREAM
    gate = gateway.app[ADMISSION]
    async with silent_client(gateway, "/v1/completions", tenant["api_key"], body):
        assert await wait_for(lambda: gate.tenant_to_in_flight.get(tenant["id"]) == 8, 20.0)
        freed = await wait_for(lambda: tenant["id"] not in gate.tenant_to_in_flight)
        held = gate.tenant_to_in_flight.get(tenant["id"], 0)
        assert freed, f"{held} slots still held {BOUND_S:g} s on by a stream nobody reads"
        rows = await wait_records(gateway, 1)  # recorded while the socket is still open
        deadline = time.monotonic() + BOUND_S
        while await worker_busy(worker_url) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert await worker_busy(worker_url) == 0, "the worker still generates the cut stream"
    assert [(row.status, row.outcome) for row in rows] == [(499, OUTCOME_CLIENT_CANCELLED)]
    assert rows[0].completion_tokens < 8 * 2000  # what reached the socket, not the whole answer


def endless_upstream(closed: asyncio.Event) -> web.Application:
    """An upstream streaming large chunks until its client goes away (``closed`` is set then)."""

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for _ in range(1_000_000):
                await response.write(sse_chunk("x" * 1024))
        except (ConnectionError, asyncio.CancelledError):
            closed.set()
            raise
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def test_an_upstream_stream_nobody_reads_is_cut_and_frees_its_slots(
    aiohttp_client, aiohttp_server, sqlite_template, tmp_path
):
    closed = asyncio.Event()
    server = await aiohttp_server(endless_upstream(closed))
    url = str(server.make_url("/v1"))
    app = front_app(
        sqlite_template, tmp_path / "front", url, api_key="k", stream_write_timeout_s=WRITE_TIMEOUT_S
    )
    front = await aiohttp_client(app)
    tenant = await create_tenant(front)
    body = {"model": PUBLIC_MODEL, "messages": messages("x"), "stream": True}
    gate = front.app[ADMISSION]
    async with silent_client(front, "/v1/chat/completions", tenant["api_key"], body):
        assert await wait_for(lambda: tenant["id"] in gate.tenant_to_in_flight, 20.0)
        freed = await wait_for(lambda: tenant["id"] not in gate.tenant_to_in_flight)
        assert freed, f"the slot is still held {BOUND_S:g} s on by a stream nobody reads"
        rows = await wait_records(front, 1)
        await asyncio.wait_for(closed.wait(), BOUND_S)  # the upstream's stream was closed too
    assert [(row.status, row.outcome) for row in rows] == [(499, OUTCOME_CANCELLED_ESTIMATED)]
    assert rows[0].completion_tokens > 0  # one token per relayed chunk: an estimate of what was sent
