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


async def tenant_key(config) -> str:
    """A tenant's API key, created through the served admin API."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"http://{config.host}:{config.port}/admin/v1/tenants",
            json={"name": "uploader"},
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
        small = await exchange(served_small, head + b"Content-Length: 2\r\n\r\n{}")  # small ones still fit
        assert small.startswith(b"HTTP/1.1 400 "), small[:200]
    finally:
        writer.close()
