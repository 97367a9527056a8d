"""Error mapping that needs no worker: auth, JSON, types, missing fields, size limit, routes."""

import dataclasses

import pytest

from gateway.app import create_app
from tests.gateway.conftest import create_tenant


def assert_openai_error(body: dict, error_type: str) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code", "request_id"}
    assert body["error"]["type"] == error_type and body["error"]["message"]


@pytest.fixture
async def key(client) -> str:
    return (await create_tenant(client))["api_key"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_missing_and_bad_keys_are_401(client, path):
    for headers in ({}, {"Authorization": "Bearer sk-pg-wrong"}, {"Authorization": "Basic abc"}):
        response = await client.post(path, json={"model": "m", "prompt": "x"}, headers=headers)
        assert response.status == 401
        assert_openai_error(await response.json(), "authentication_error")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
        ({"model": "m"}, "messages"),
        ({"model": 3, "messages": []}, "model"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"content": "hi"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": [1]}, "stop"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": "1"}, "seed"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": {}}, "tools"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 9}, "n"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "user": 7}, "user"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x", "name": {"a": 1}}]},
            "messages[0].name",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x", "name": ["a"]}]}, "messages[0].name"),
        ({"model": "m", "messages": [{"role": "user", "content": "x", "name": "a\x00"}]}, "messages[0].name"),
        (
            {"model": "m", "messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]},
            "messages[0].tool_call_id",
        ),
        *(
            (
                {
                    "model": "m",
                    "messages": [{"role": "user", "content": "x"}],
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": bad}}],
                    "tool_choice": choice,
                },
                "tools[0].function.parameters",
            )
            for bad in ([], 0, "", "x")
            for choice in ("auto", "none")
        ),
    ],
)
async def test_chat_validation_is_400(client, key, body, param):
    response = await client.post(
        "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    )
    assert response.status == 400
    payload = await response.json()
    assert_openai_error(payload, "invalid_request_error")
    assert payload["error"]["param"] == param


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m"},
        {"model": "m", "prompt": 5},
        {"model": "m", "prompt": ["a", "b"]},
        {"model": "m", "prompt": [-1]},
        {"model": "m", "prompt": "x", "echo": True},
    ],
)
async def test_completion_validation_is_400(client, key, body):
    response = await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert response.status == 400
    assert_openai_error(await response.json(), "invalid_request_error")


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
async def test_malformed_json_is_400(client, key, raw):
    response = await client.post("/v1/chat/completions", data=raw, headers={"Authorization": f"Bearer {key}"})
    assert response.status == 400
    body = await response.json()
    assert_openai_error(body, "invalid_request_error")
    assert body["error"]["code"] == "invalid_json"


async def test_body_over_limit_is_413(aiohttp_client, config):
    client = await aiohttp_client(create_app(dataclasses.replace(config, max_body_bytes=2048)))
    key = (await create_tenant(client))["api_key"]
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 4096}]}
    response = await client.post(
        "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    )
    assert response.status == 413
    payload = await response.json()
    assert_openai_error(payload, "invalid_request_error")
    assert payload["error"]["code"] == "request_too_large"


async def test_no_worker_is_503_and_unknown_route_404(client, key):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    response = await client.post(
        "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    )
    assert response.status == 503
    assert_openai_error(await response.json(), "service_unavailable")
    missing = await client.get("/v1/nope")
    assert missing.status == 404
    assert_openai_error(await missing.json(), "not_found_error")
    wrong_method = await client.get("/v1/chat/completions")
    assert wrong_method.status == 405
    health = await client.get("/healthz")
    assert health.status == 503 and (await health.json())["workers_healthy"] == 0
