"""``Expect`` and ``Content-Encoding`` against the gateway as served (``gateway.up._serve``), review r15
#3 and #4.

No upload is invited (``100 Continue``) before its headers pass the checks a body gets (request id,
size, key, coding, reading budget), nor on any path or method that reads no body (404, 405, /healthz);
every refusal is OpenAI's error JSON with the request id; a body's coding is decoded within the
body limit, and a coding the gateway does not decode is a 415 naming the header, never an ERROR log or a
body read as if it were plain.
"""

import asyncio
import gzip
import json
import logging
import threading
import time
import zlib

import pytest

from gateway import slow_clients
from gateway.content_encoding import MAX_GZIP_MEMBERS, decode_body
from gateway.errors import InvalidRequest
from tests.security.test_slow_clients import (  # noqa: F401 - fixtures
    exchange,
    served,
    served_small,
    tenant_key,
)

BODY = json.dumps(
    {"model": "random-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
).encode()


def head(path: str, token: str, extra: bytes, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
        f"Authorization: Bearer {token}\r\nContent-Length: {length}\r\n".encode()
        + extra
        + b"\r\n"
    )


def chat(token: str, extra: bytes, body: bytes = BODY) -> bytes:
    return head("/v1/chat/completions", token, extra, len(body)) + body


def openai_error(answer: bytes, status: int) -> dict:
    """The answer's error object, after checking its status, JSON body and x-request-id."""
    status_line, _, rest = answer.partition(b"\r\n")
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert int(status_line.split()[1]) == status, answer[:300]
    assert b"application/json" in headers and b"x-request-id: req_" in headers.lower(), answer[:300]
    error = json.loads(body)["error"]
    assert error["message"] and error["type"] and error["request_id"].startswith("req_"), error
    return error


async def test_an_unknown_expectation_is_an_openai_417(served):  # noqa: F811
    answer = await exchange(served, chat(await tenant_key(served), b"Expect: 200-ok\r\n"))
    assert openai_error(answer, 417)["param"] == "Expect"


async def test_a_bad_key_is_a_401_before_100_continue(served):  # noqa: F811
    """docs/operations.md: a bad key is a 401 without reading; with 'Expect: 100-continue' the client
    waits for the 100 before it uploads: it gets the 401 instead, and never uploads."""
    answer = await exchange(
        served, head("/v1/chat/completions", "sk-not-a-key", b"Expect: 100-continue\r\n", 9)
    )
    assert openai_error(answer, 401)["code"] == "invalid_api_key"


async def test_a_body_over_the_limit_is_a_413_before_100_continue(served):  # noqa: F811
    key = await tenant_key(served)
    answer = await exchange(served, head("/v1/chat/completions", key, b"Expect: 100-continue\r\n", 50 << 20))
    openai_error(answer, 413)


async def test_100_continue_is_sent_once_the_headers_pass(served):  # noqa: F811
    body = json.dumps({"name": "continued"}).encode()
    reader, writer = await asyncio.open_connection(served.host, served.port)
    try:
        writer.write(head("/admin/v1/tenants", served.admin_token, b"Expect: 100-continue\r\n", len(body)))
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)  # invited: now the body
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 201 "), answer[:300]


@pytest.mark.parametrize("coding", [b"br", b"foo", b"compress", b"gzip, gzip", b"zstd"])
async def test_a_coding_the_gateway_does_not_decode_is_a_415_without_an_error_log(
    served,  # noqa: F811
    caplog,
    coding,
):
    key = await tenant_key(served)
    with caplog.at_level(logging.ERROR):
        answer = await exchange(served, chat(key, b"Content-Encoding: " + coding + b"\r\n"))
    error = openai_error(answer, 415)
    assert error["param"] == "Content-Encoding" and error["code"] == "unsupported_content_encoding"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize(
    ("coding", "encode"),
    [
        (b"gzip", gzip.compress),
        (b"x-gzip", lambda data: gzip.compress(data[:5]) + gzip.compress(data[5:])),  # two members
        (b"deflate", zlib.compress),
        (b"deflate", lambda data: zlib.compress(data, wbits=-zlib.MAX_WBITS)),  # raw, no zlib header
        (b"identity", bytes),
    ],
    ids=["gzip", "x_gzip_two_members", "deflate", "raw_deflate", "identity"],
)
async def test_an_encoded_admin_body_is_decoded(served, coding, encode):  # noqa: F811
    body = encode(json.dumps({"name": "encoded", "rate_limit_rpm": 7}).encode())
    extra = b"Content-Encoding: " + coding + b"\r\n"
    answer = await exchange(served, head("/admin/v1/tenants", served.admin_token, extra, len(body)) + body)
    assert answer.startswith(b"HTTP/1.1 201 "), answer[:300]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["rate_limit_rpm"] == 7


async def test_a_gzip_bomb_is_a_413(served):  # noqa: F811
    bomb = gzip.compress(b" " * (served.max_body_bytes + 1))
    assert len(bomb) < served.max_body_bytes // 100
    answer = await exchange(served, chat(await tenant_key(served), b"Content-Encoding: gzip\r\n", bomb))
    openai_error(answer, 413)


@pytest.mark.parametrize(
    "body",
    [gzip.compress(BODY)[:-12], b"\x1f\x8b not gzip", gzip.compress(BODY) + b"x"],
    ids=["truncated", "not_gzip", "trailing_data"],
)
async def test_a_gzip_body_that_does_not_decode_is_a_400(served, body):  # noqa: F811
    answer = await exchange(served, chat(await tenant_key(served), b"Content-Encoding: gzip\r\n", body))
    assert openai_error(answer, 400)["code"] == "invalid_body"


def chunked(token: str, transfer_coding: bytes, body: bytes = BODY) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nAuthorization: Bearer " + token.encode() + b"\r\n"
        b"Transfer-Encoding: "
        + transfer_coding
        + b"\r\n\r\n"
        + b"%x\r\n" % len(body)
        + body
        + b"\r\n0\r\n\r\n"
    )


@pytest.mark.parametrize("coding", [b"gzip, chunked", b"identity, chunked", b"foo,chunked"])
async def test_a_transfer_coding_besides_chunked_is_a_501(served, coding):  # noqa: F811
    """RFC 9112 §6.1: a transfer coding the server does not understand is a 501; aiohttp frames the body
    as chunked and would hand it on still gzip-encoded (or as if 'foo' meant nothing)."""
    answer = await exchange(served, chunked(await tenant_key(served), coding))
    assert openai_error(answer, 501)["param"] == "Transfer-Encoding"


async def test_a_chunked_body_is_still_read(served):  # noqa: F811
    """Only 'chunked' passes: the request is read (and fails later only for want of a worker)."""
    answer = await exchange(served, chunked(await tenant_key(served), b"chunked"))
    assert openai_error(answer, 503)


async def test_every_route_answers_an_unknown_expectation_with_an_openai_417(served):  # noqa: F811
    """Routes are registered with ``expect_handler=expect_continue`` one by one: a route added without
    it would answer aiohttp's plain-text 417 (and invite uploads before checking the key)."""
    from gateway.app import create_app

    app = create_app(served)
    routes = {(route.method, route.resource.canonical) for route in app.router.routes()}
    assert len(routes) > 20 and any(path.startswith("/admin/v1/") for _, path in routes)
    for method, path in sorted(routes):
        if method in ("HEAD", "*"):  # "*": route_everything's 404 and 405 (tested below)
            continue
        path = path.replace("{", "").replace("}", "")  # {tenant_id} -> tenant_id: any id will do
        request = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nExpect: 200-ok\r\n\r\n"
        answer = await exchange(served, request.encode())
        assert openai_error(answer, 417)["param"] == "Expect", (method, path)


EMPTY_MEMBER = gzip.compress(b"", mtime=0)  # 20 bytes that decode to nothing


async def _longest_loop_stall_s(work) -> tuple[float, object]:
    """``await work`` while a ticker on this loop (the served gateway's too) measures its longest gap."""
    longest_s, done = 0.0, asyncio.Event()

    async def ticker() -> None:
        nonlocal longest_s
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(0.02)
            now = time.monotonic()
            longest_s, last = max(longest_s, now - last), now

    ticking = asyncio.create_task(ticker())
    try:
        result = await work
    finally:
        done.set()
        await ticking
    return longest_s, result


async def test_many_tiny_gzip_members_are_a_400_without_holding_the_loop(served):  # noqa: F811
    """Review r19 #1: 2 MiB of empty members (within max_body_bytes) held the event loop ~9 s, every
    member copying the rest of the body; now past MAX_GZIP_MEMBERS it is a 400, found in linear time."""
    body = EMPTY_MEMBER * ((2 << 20) // len(EMPTY_MEMBER))
    assert len(body) <= served.max_body_bytes
    key = await tenant_key(served)
    request = chat(key, b"Content-Encoding: gzip\r\n", body)
    # A margin for a loaded machine: before, the stall was 9 s at load 11.
    stall_s, answer = await _longest_loop_stall_s(exchange(served, request))
    assert stall_s < 2.0, f"one tenant's gzip body held the event loop {stall_s:.1f} s"
    error = openai_error(answer, 400)
    assert error["code"] == "invalid_body" and f"more than {MAX_GZIP_MEMBERS}" in error["message"]


def test_gzip_members_up_to_the_cap_decode():
    message = b'{"model": "m"}'
    members = [gzip.compress(message[i : i + 1]) for i in range(len(message))]
    padding = [EMPTY_MEMBER] * (MAX_GZIP_MEMBERS - len(members))
    assert decode_body(b"".join(members + padding), "gzip", 1 << 20) == message
    with pytest.raises(InvalidRequest, match="members"):
        decode_body(b"".join([*members, *padding, EMPTY_MEMBER]), "gzip", 1 << 20)


async def test_no_100_continue_for_an_upload_the_reading_budget_refuses(served_small):  # noqa: F811
    """Review r19 #2: the 100 went out once size, key and coding passed; the reading budget (503) then
    refused the 1 MiB the client had been invited to send."""
    hog, victim = await tenant_key(served_small, "hog"), await tenant_key(served_small, "victim")
    _, hog_writer = await asyncio.open_connection(served_small.host, served_small.port)
    try:  # a slow 1 MiB upload holds 1 MiB of the 1.5 MiB budget: another 1 MiB would pass it
        hog_writer.write(head("/v1/chat/completions", hog, b"", 1 << 20) + b"{")
        await hog_writer.drain()
        await asyncio.sleep(0.5)
        extra = b"Expect: 100-continue\r\n"
        answer = await exchange(served_small, head("/v1/chat/completions", victim, extra, 1 << 20))
    finally:
        hog_writer.close()
    assert openai_error(answer, 503)["code"] == "server_busy"  # at once: no 100 before it


async def test_no_100_continue_for_a_malformed_request_id(served):  # noqa: F811
    extra = b"Expect: 100-continue\r\nX-Request-Id: not a valid id!\r\n"
    answer = await exchange(served, head("/v1/chat/completions", await tenant_key(served), extra, 1 << 20))
    assert openai_error(answer, 400)["code"] == "invalid_request_id"


UNROUTED = [b"POST /v1/no-such-route", b"PUT /v1/chat/completions", b"POST /admin/v1/nope", b"PUT /admin/v1"]
IDS = ["404", "405", "admin_404", "admin_root"]


@pytest.mark.parametrize("line", UNROUTED, ids=IDS)
async def test_an_unknown_expectation_off_the_routes_is_an_openai_417(served, line):  # noqa: F811
    """Review r19 #3: no route, or a wrong method, got aiohttp's default: a plain-text 417."""
    answer = await exchange(
        served, line + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\nExpect: 200-ok\r\n\r\n"
    )
    assert openai_error(answer, 417)["param"] == "Expect"


@pytest.mark.parametrize(
    "line", [*UNROUTED, b"POST /healthz", b"GET /healthz"], ids=[*IDS, "healthz_post", "healthz_get"]
)
async def test_no_100_continue_for_a_body_that_is_never_read(served, line):  # noqa: F811
    """Review r19 #3: no route, or a wrong method, got aiohttp's default: a 100 Continue, then the 404."""
    request = line + b" HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 1000000\r\n\r\n"
    answer = await exchange(served, request)  # the connection is closed: the body is never sent
    assert answer.startswith(b"HTTP/1.1 ") and not answer.startswith(b"HTTP/1.1 100 "), answer[:300]
    assert b"\r\nConnection: close\r\n" in answer, answer[:300]


async def test_an_encoded_body_is_decoded_off_the_event_loop(served, monkeypatch):  # noqa: F811
    """Inflating up to max_body_bytes takes tens of milliseconds: on the CPU pool, in the tenant's share,
    as a large JSON body is parsed (the decoder is spied on, not replaced)."""
    threads: list[str] = []

    def spied(*args):
        threads.append(threading.current_thread().name)
        return decode_body(*args)

    monkeypatch.setattr(slow_clients, "decode_body", spied)
    answer = await exchange(
        served, chat(await tenant_key(served), b"Content-Encoding: gzip\r\n", gzip.compress(BODY))
    )
    assert openai_error(answer, 503)  # decoded and parsed: only no worker is ready
    assert threads and all(name.startswith("gateway-cpu") for name in threads), threads
