"""Findings of the hostile-input review, against the real gateway: each bad input is a 4xx OpenAI error
(never a 500, never a lost usage record), and no body stalls the event loop for other tenants."""

import asyncio
import json

import orjson
import pytest

from gateway.json_body import check_json_shape
from tests.gateway.conftest import create_tenant
from tests.gateway.test_gateway_e2e import auth, chat_body
from tests.security.test_input_hardening import assert_openai_error
from tests.security.test_slow_clients import HEAD, exchange, served  # noqa: F401 - fixture


async def _post(client, key, body) -> tuple[int, dict]:
    response = await client.post("/v1/chat/completions", json=body, headers=auth(key))
    return response.status, await response.json()


@pytest.mark.parametrize(
    ("field", "value"),
    [("user", "alice\x00"), ("user", "a\nb"), ("safety_identifier", "x\x00"), ("model", "random-tiny\x00")],
)
async def test_control_characters_in_client_identifiers_are_a_400(client, field, value):
    key = (await create_tenant(client))["api_key"]
    body = chat_body("s")
    body[field] = value
    status, error = await _post(client, key, body)
    assert status == 400, error
    assert_openai_error(error)
    assert error["error"]["param"] == field


@pytest.mark.parametrize("token", ["\u00b2", "\u0661\u0662", "", "+1", " 1"])
async def test_logit_bias_keys_must_be_ascii_digits(client, token):
    key = (await create_tenant(client))["api_key"]
    status, error = await _post(client, key, chat_body("s", logit_bias={token: 1}))
    assert status == 400, error
    assert error["error"]["param"] == "logit_bias"


BIG_BODIES = {
    "empty_lists": {"x": [[]] * 1_300_000},
    "zeros": {"x": [0] * 2_000_000},
    "many_keys": {f"k{i}": 0 for i in range(350_000)},
    "many_messages": {"messages": [{"role": "user", "content": ""}] * 130_000},
}


@pytest.mark.parametrize("name", sorted(BIG_BODIES))
def test_a_body_with_too_many_values_is_refused_from_its_bytes(name):
    body = orjson.dumps({**chat_body("s"), **BIG_BODIES[name]})
    assert len(body) < 4 * 1024 * 1024
    with pytest.raises(Exception) as raised:
        check_json_shape(body)
    assert raised.value.code == "too_many_json_values"


@pytest.mark.parametrize(
    "text",
    [
        '{"a": "[[[[{{{{' + "[" * 200 + '"}',  # brackets inside a string are text, not nesting
        '{"a": "\\"[[[[", "b": "\\\\", "c": [' + "[" * 60 + "]" * 60 + "]}",
        json.dumps({"prompt": list(range(200_000))}),
        json.dumps({"content": "a,b,c[{" * 300_000}),
    ],
)
def test_legitimate_bodies_pass_the_shape_check(text):
    check_json_shape(text.encode())


async def test_a_huge_cheap_to_send_body_is_a_400_and_other_tenants_are_served_meanwhile(client):
    a = (await create_tenant(client, name="a"))["api_key"]
    b = (await create_tenant(client, name="b"))["api_key"]
    body = orjson.dumps({**chat_body("s"), "x": [[]] * 1_300_000})
    sent = asyncio.create_task(
        client.post(
            "/v1/chat/completions", data=body, headers={**auth(a), "Content-Type": "application/json"}
        )
    )
    served_meanwhile = 0
    while not sent.done():
        response = await client.get("/v1/models", headers=auth(b))
        assert response.status == 200
        served_meanwhile += 1
    response = await sent
    error = await response.json()
    assert response.status == 400, error
    assert error["error"]["code"] == "too_many_json_values"
    assert served_meanwhile >= 1  # the loop answered b while a's 3.9 MB arrived and was refused


async def _raw(client, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(head + body)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), timeout=10)
    writer.close()
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


@pytest.mark.parametrize("authenticated", [True, False])
async def test_a_corrupt_compressed_body_is_a_400(client, authenticated):
    key = (await create_tenant(client))["api_key"]
    body = json.dumps(chat_body("s")).encode()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + (b"Authorization: Bearer " + key.encode() + b"\r\n" if authenticated else b"")
        + b"Content-Encoding: gzip\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    )
    status, answer = await _raw(client, head, body)
    assert status == (400 if authenticated else 401), answer  # without a key the body is never read
    assert b"Traceback" not in answer
    assert_openai_error(json.loads(answer))


@pytest.mark.parametrize(
    "headers",
    [
        b"x-big: " + b"a" * 9000 + b"\r\n",
        b"".join(b"x-h%d: 1\r\n" % i for i in range(200)),
        b"Content-Length: abc\r\n",
    ],
    ids=["header_too_long", "too_many_headers", "bad_content_length"],
)
async def test_malformed_request_heads_get_an_openai_error(served, headers):  # noqa: F811
    """Refused by aiohttp's parser before any middleware: the served gateway (``gateway.up``) still
    answers with OpenAI's error JSON."""
    head = HEAD + headers + b"\r\n"
    answer = await exchange(served, head + b"{}")
    status_line, _, rest = answer.partition(b"\r\n")
    assert b" 400 " in status_line or b" 431 " in status_line, answer[:300]
    assert b"application/json" in rest.partition(b"\r\n\r\n")[0]
    assert_openai_error(json.loads(rest.partition(b"\r\n\r\n")[2]))


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    "tool_calls",
    [
        "call me",
        [1],
        CALL,  # an object, not a list
        [{"id": "c1", "type": "function"}],  # no function
        [{"id": "c1", "type": "function", "function": "f"}],  # the template's tojson crashed: a 500
        [{"id": "c1", "type": "function", "function": {"name": "f"}}],  # no arguments: a 500 too
        [{"id": "c1", "type": "function", "function": {"name": 5, "arguments": "{}"}}],
        [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": [1, 2]}}],
        [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": None}}],
        [{"id": 7, "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        [{"id": "c1", "type": "retrieval", "function": {"name": "f", "arguments": "{}"}}],
    ],
)
async def test_malformed_assistant_tool_calls_are_a_400(gateway, tool_calls):
    key = (await create_tenant(gateway))["api_key"]
    body = chat_body("s")
    at = len(body["messages"])
    body["messages"] += [
        {"role": "assistant", "content": None, "tool_calls": tool_calls},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "user", "content": "go on"},
    ]
    status, error = await _post(gateway, key, body)
    assert status == 400, error
    assert error["error"]["param"].startswith(f"messages[{at}].tool_calls"), error
