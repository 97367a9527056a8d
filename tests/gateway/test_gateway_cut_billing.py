"""A stream cut for not being read is billed only what left the gateway (review r8 #5).

Tokens counted as delivered once ``write()`` returned, that is once their bytes were in aiohttp's
buffer; the cut's ``transport.abort()`` throws that buffer away, so ~190 tokens the client could never
receive were billed. Now a token counts once its chunk's bytes all left the buffer (into the kernel,
which still sends them after the abort). Here a silent socket is cut, then reads everything that left
the gateway: it must have received at least what it is billed. Both paths: the bundled worker's
(exact token counts) and an external upstream's (one token per relayed chunk, ``cancelled_estimated``).
"""

from __future__ import annotations

import asyncio
import json
import socket

from tenancy.usage_types import OUTCOME_CANCELLED_ESTIMATED, OUTCOME_CLIENT_CANCELLED
from tests.gateway.conftest import create_tenant
from tests.gateway.test_gateway_billing import wait_records
from tests.gateway.test_gateway_stalled_stream import (
    BIG_STREAM,
    BOUND_S,
    cutting_gateway,
    endless_upstream,
    silent_client,
)
from tests.gateway.test_gateway_upstream_openai import PUBLIC_MODEL, front_app, messages

WRITE_TIMEOUT_S = 1.0


async def read_to_end(sock: socket.socket, timeout_s: float = 20.0) -> bytes:
    """Everything the socket receives until its close (or ``timeout_s`` of silence)."""
    loop = asyncio.get_running_loop()
    data = bytearray()
    while True:
        try:
            part = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), timeout_s)
        except (ConnectionError, TimeoutError):
            break
        if not part:
            break
        data += part
    return bytes(data)


def received_chunks(raw: bytes) -> list[dict]:
    """The SSE chunks received whole (a chunk cut in the middle by the close does not count)."""
    chunks = []
    for line in raw.split(b"\r\n\r\n", 1)[1].split(b"\n"):
        line = line.strip()
        if line.startswith(b"data: {"):
            try:
                chunks.append(json.loads(line[6:]))
            except ValueError:  # cut by the chunked framing, or by the end
                continue
    return chunks


async def test_a_cut_worker_stream_bills_only_what_left_the_gateway(
    aiohttp_client, sqlite_url, tmp_path, worker_url
):
    gateway, tenant = await cutting_gateway(aiohttp_client, sqlite_url, tmp_path, worker_url)
    body = BIG_STREAM  # large chunks: the buffer the abort discards holds many tokens
    async with silent_client(gateway, "/v1/completions", tenant["api_key"], body) as sock:
        rows = await wait_records(gateway, 1, BOUND_S)
        assert [(row.status, row.outcome) for row in rows] == [(499, OUTCOME_CLIENT_CANCELLED)]
        raw = await read_to_end(sock)  # everything that left the gateway, then its close
    received = sum(
        len((choice.get("logprobs") or {}).get("tokens") or [])
        for chunk in received_chunks(raw)
        for choice in chunk.get("choices", [])
    )
    assert 0 < rows[0].completion_tokens <= received, f"billed {rows[0].completion_tokens}, got {received}"


async def test_a_cut_upstream_stream_bills_only_what_left_the_gateway(
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
    async with silent_client(front, "/v1/chat/completions", tenant["api_key"], body) as sock:
        rows = await wait_records(front, 1, BOUND_S)
        assert [(row.status, row.outcome) for row in rows] == [(499, OUTCOME_CANCELLED_ESTIMATED)]
        raw = await read_to_end(sock)
    received = sum(1 for chunk in received_chunks(raw) for choice in chunk["choices"] if choice["delta"])
    assert 0 < rows[0].completion_tokens <= received, f"billed {rows[0].completion_tokens}, got {received}"
