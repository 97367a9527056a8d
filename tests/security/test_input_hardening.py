"""Bad input gets a 4xx OpenAI-style error, never a 500 (issue 11, input hardening)."""

import asyncio
import json

import pytest

from tests.gateway.conftest import ADMIN, create_tenant
from tests.gateway.test_gateway_e2e import auth, chat_body


def assert_openai_error(body: dict) -> None:
    assert set(body["error"]) >= {"message", "type", "code"}, body


@pytest.mark.parametrize("role", [["user"], {"x": 1}, 7, True])
async def test_message_role_of_the_wrong_type_is_a_400(client, role):
    key = (await create_tenant(client))["api_key"]
    body = chat_body("system", "hi")
    body["messages"][1]["role"] = role
    response = await client.post("/v1/chat/completions", json=body, headers=auth(key))
    assert response.status == 400, await response.text()
    error = await response.json()
    assert_openai_error(error)
    assert error["error"]["param"] == "messages[1].role"


async def test_deeply_nested_tools_are_rejected_before_parsing(gateway):
    client = gateway
    key = (await create_tenant(client))["api_key"]
    parameters = '{"a": ' * 900 + "{}" + "}" * 900  # below orjson's own limit of 1024
    text = json.dumps(chat_body("system", "hi"))[:-1]
    text += ', "tools": [{"type": "function", "function": {"name": "f", "parameters": ' + parameters + "}}]}"
    response = await client.post(
        "/v1/chat/completions", data=text, headers={**auth(key), "Content-Type": "application/json"}
    )
    assert response.status == 400, await response.text()
    error = await response.json()
    assert_openai_error(error)
    assert "nested" in error["error"]["message"]


async def test_non_utf8_authorization_header_is_a_401(client):
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\xc3(\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    )
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), timeout=10)
    writer.close()
    status_line = answer.split(b"\r\n", 1)[0]
    assert b" 401 " in status_line, answer[:300]
    assert b'"authentication_error"' in answer


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens_limit", 2**63),
        ("isolation", ["shared"]),
        ("isolation", {"a": 1}),
        ("rate_limit_rpm", 2**70),
    ],
)
async def test_admin_patch_with_out_of_range_or_unhashable_values_is_a_400(client, field, value):
    tenant = await create_tenant(client)
    response = await client.patch(f"/admin/v1/tenants/{tenant['id']}", json={field: value}, headers=ADMIN)
    assert response.status == 400, await response.text()
    error = await response.json()
    assert_openai_error(error)
    assert error["error"]["param"] == field
