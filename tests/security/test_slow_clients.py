"""Slow headers, slow bodies and lying Content-Lengths get an answer or a closed socket (issue 11)."""

import asyncio
import dataclasses

import aiohttp
import pytest

from gateway.app import create_app
from gateway.up import _serve, free_port

HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    b"Content-Type: application/json\r\nConnection: close\r\n"
)
BOUND_S = 10  # generous: the configured timeouts are 1 s; main held such connections 40 s and more


@pytest.fixture
async def served(config):
    config = dataclasses.replace(config, port=free_port(), header_timeout_s=1.0, read_timeout_s=1.0)
    serving = await _serve(create_app(config), config)
    yield config
    await serving.cleanup()


async def exchange(config, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(config.host, config.port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(65536), timeout=BOUND_S)  # b'' once the server closes
    finally:
        writer.close()


async def test_a_request_head_that_never_ends_is_cut_off(served):
    answer = await exchange(served, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    assert b" 200 " not in answer


async def tenant_key(config, name: str = "uploader") -> str:
    """A tenant's API key, created through the served admin API."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"http://{config.host}:{config.port}/admin/v1/tenants",
            json={"name": name},
            headers={"Authorization": f"Bearer {config.admin_token}"},
        ) as response,
    ):
        assert response.status == 201, await response.text()
        return (await response.json())["api_key"]


async def test_a_body_that_never_comes_is_a_408(served):
    head = HEAD + f"Authorization: Bearer {await tenant_key(served)}\r\n".encode()
    answer = await exchange(served, head + b'Content-Length: 100\r\n\r\n{"model":')
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b'"request_timeout"' in answer


async def test_a_huge_content_length_is_refused_before_reading(served):
    head = HEAD
    answer = await exchange(served, head + f"Content-Length: {50 << 20}\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b'"request_too_large"' in answer


async def test_a_body_without_a_valid_key_is_refused_before_it_is_read(served):
    for auth in (
        b"",
        b"Authorization: Bearer sk-pg-wrong\r\n",
    ):  # the body never comes: no 408, a 401 at once
        answer = await exchange(served, HEAD + auth + b"Content-Length: 1000000\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
        assert b'"authentication_error"' in answer


@pytest.fixture
async def served_small(config):
    config = dataclasses.replace(
        config, port=free_port(), read_timeout_s=5.0, max_body_bytes=1 << 20, max_reading_body_bytes=3 << 19
    )
    serving = await _serve(create_app(config), config)
    yield config
    await serving.cleanup()


async def test_bodies_being_read_at_once_are_bounded_in_bytes(served_small):
    key = await tenant_key(served_small)
    head = HEAD + f"Authorization: Bearer {key}\r\n".encode()
    _, writer = await asyncio.open_connection(served_small.host, served_small.port)
    try:  # a slow upload of 1 MiB holds its bytes; another one would pass the 1.5 MiB bound
        writer.write(head + b"Content-Length: 1048576\r\n\r\n{")
        await writer.drain()
        await asyncio.sleep(0.5)  # the first upload reaches the body read (a loaded machine: generous)
        answer = await exchange(served_small, head + b"Content-Length: 1048576\r\n\r\n{")
        assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
        assert b"Retry-After" in answer and b'"server_busy"' in answer
        other = HEAD + f"Authorization: Bearer {await tenant_key(served_small, 'other')}\r\n".encode()
        small = await exchange(served_small, other + b"Content-Length: 2\r\n\r\n{}")  # small ones still fit
        assert small.startswith(b"HTTP/1.1 400 "), small[:200]
    finally:
        writer.close()


@pytest.mark.parametrize(
    "anonymous_head",
    [
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n",
        b"GET /metrics HTTP/1.1\r\nHost: x\r\n",
        b"POST /no-such-route HTTP/1.1\r\nHost: x\r\n",
        b"PUT /v1/chat/completions HTTP/1.1\r\nHost: x\r\n",  # 405
    ],
)
async def test_a_body_no_key_authorizes_does_not_hold_the_reading_budget(served_small, anonymous_head):
    key = await tenant_key(served_small)
    _, writer = await asyncio.open_connection(served_small.host, served_small.port)
    try:  # a keyless slow upload of 1 MiB, then a tenant's complete 0.6 MiB request (fits 1.5 MiB)
        writer.write(anonymous_head + b"Content-Length: 1048576\r\n\r\n{")
        await writer.drain()
        await asyncio.sleep(0.5)
        body = b'{"messages":[],"padding":"' + b"x" * (600 << 10) + b'"}'
        head = HEAD + f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        answer = await exchange(served_small, head + body)
        assert answer.startswith(b"HTTP/1.1 400 "), answer[:300]  # read and refused as a request: no 503
    finally:
        writer.close()


async def test_one_tenant_holds_at_most_half_the_reading_budget(served_small):
    hog = HEAD + f"Authorization: Bearer {await tenant_key(served_small, 'hog')}\r\n".encode()
    victim = HEAD + f"Authorization: Bearer {await tenant_key(served_small, 'victim')}\r\n".encode()
    writers = []
    try:  # the hog's first 0.7 MiB slow upload is let in; its second would pass half of 1.5 MiB
        _, writer = await asyncio.open_connection(served_small.host, served_small.port)
        writers.append(writer)
        writer.write(hog + f"Content-Length: {7 * (1 << 20) // 10}\r\n\r\n{{".encode())
        await writer.drain()
        await asyncio.sleep(0.5)
        second = await exchange(
            served_small, hog + f"Content-Length: {7 * (1 << 20) // 10}\r\n\r\n{{".encode()
        )
        assert second.startswith(b"HTTP/1.1 503 "), second[:300]
        body = b'{"messages":[],"padding":"' + b"x" * (200 << 10) + b'"}'
        answer = await exchange(served_small, victim + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert answer.startswith(b"HTTP/1.1 400 "), answer[:300]
    finally:
        for writer in writers:
            writer.close()
