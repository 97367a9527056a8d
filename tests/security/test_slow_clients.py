"""Slow headers, slow bodies and lying Content-Lengths get an answer or a closed socket (issue 11)."""

import asyncio
import dataclasses

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


async def test_a_body_that_never_comes_is_a_408(served):
    head = HEAD
    answer = await exchange(served, head + b'Content-Length: 100\r\n\r\n{"model":')
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b'"request_timeout"' in answer


async def test_a_huge_content_length_is_refused_before_reading(served):
    head = HEAD
    answer = await exchange(served, head + f"Content-Length: {50 << 20}\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b'"request_too_large"' in answer
