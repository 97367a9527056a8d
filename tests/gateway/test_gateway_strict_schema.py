"""``strict: true`` on ``response_format.json_schema`` and ``tools[].function`` is OpenAI's strict mode,
never silently ignored (review r12 #1): a schema that leaves a property optional or allows extra ones is
a 400 naming it, as OpenAI answers; a non-boolean ``strict`` is a 400; the schemas the openai SDK sends
for ``parse(response_format=Model)`` are accepted."""

import json
from typing import Literal

import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel

from gateway.errors import InvalidRequest
from gateway.structured_output import check_strict_schema, check_strict_tools, response_format_grammar
from tests.gateway.conftest import create_tenant

LOOSE = {"type": "object", "properties": {"answer": {"type": "string"}}}
PARAM = "response_format.json_schema.schema"


class Street(BaseModel):
    name: str
    number: int | None


class Place(BaseModel):
    kind: Literal["city", "town"]
    streets: list[Street]
    main: Street | None
    tags: dict[str, int] | None = None


def _json_schema(schema, strict=True):
    return {"type": "json_schema", "json_schema": {"name": "reply", "strict": strict, "schema": schema}}


def test_the_sdk_strict_schemas_are_accepted():
    schema = to_strict_json_schema(Street)
    assert response_format_grammar(_json_schema(schema)) == {"type": "json_schema", "schema": schema}
    check_strict_schema({"type": "object", "properties": {}, "additionalProperties": False}, PARAM)


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        (LOOSE, "additionalProperties"),
        ({**LOOSE, "additionalProperties": False}, "missing: answer"),
        ({"type": "string"}, "must be an object"),
        ({"anyOf": [LOOSE]}, "must be an object"),
        (
            {
                "type": "object",
                "properties": {"inner": {"type": "array", "items": LOOSE}},
                "required": ["inner"],
                "additionalProperties": False,
            },
            "/properties/inner/items",
        ),
        ({"$ref": "#/$defs/x", "$defs": {"x": {**LOOSE, "additionalProperties": False}}}, "/$defs/x"),
    ],
)
def test_a_schema_strict_mode_refuses_is_a_400_naming_it(schema, words):
    with pytest.raises(InvalidRequest, match="strict") as refused:
        response_format_grammar(_json_schema(schema))
    assert refused.value.param == PARAM and words in str(refused.value)
    assert response_format_grammar(_json_schema(schema, strict=False))["schema"] == schema


def test_a_dict_field_is_refused_under_strict_as_openai_does():
    with pytest.raises(InvalidRequest, match="additionalProperties"):
        check_strict_schema(to_strict_json_schema(Place), PARAM)


def test_strict_must_be_a_boolean():
    with pytest.raises(InvalidRequest) as refused:
        response_format_grammar(_json_schema(LOOSE, strict="yes"))
    assert refused.value.param == "response_format.json_schema.strict"
    tool = {"type": "function", "function": {"name": "f", "strict": 1, "parameters": LOOSE}}
    with pytest.raises(InvalidRequest) as refused:
        check_strict_tools([tool])
    assert refused.value.param == "tools[0].function.strict"


@pytest.mark.parametrize("required", [5, "a", [["a"]], [{"a": 1}]])
def test_a_malformed_required_under_strict_is_a_400_not_a_500(required):
    """``required`` must be a list of names: before, ``set(required)`` raised (a 500) under strict."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False}
    schema["required"] = required
    with pytest.raises(InvalidRequest, match="required") as refused:
        response_format_grammar(_json_schema(schema))
    assert refused.value.param == PARAM
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": schema}}
    with pytest.raises(InvalidRequest, match="required") as refused:
        check_strict_tools([tool])
    assert refused.value.param == "tools[0].function.parameters"


def test_strict_tools_need_a_strict_schema():
    loose = {"type": "function", "function": {"name": "f", "strict": True, "parameters": LOOSE}}
    with pytest.raises(InvalidRequest) as refused:
        check_strict_tools([{"type": "function", "function": {"name": "g"}}, loose])
    assert refused.value.param == "tools[1].function.parameters"
    check_strict_tools([{"type": "function", "function": {**loose["function"], "strict": False}}])
    strict = {"name": "f", "strict": True, "parameters": to_strict_json_schema(Street)}
    check_strict_tools([{"type": "function", "function": strict}])


async def test_strict_json_schema_is_honoured_or_refused_end_to_end(gateway):
    key = (await create_tenant(gateway))["api_key"]
    headers = {"Authorization": f"Bearer {key}"}
    body = {
        "model": "random-tiny",
        "messages": [{"role": "user", "content": "Reply with JSON"}],
        "max_tokens": 64,
        "seed": 1,
        "response_format": _json_schema(LOOSE),
    }
    response = await gateway.post("/v1/chat/completions", json=body, headers=headers)
    answer = await response.json()
    assert response.status == 400 and answer["error"]["param"] == PARAM, answer
    strict_schema = {**LOOSE, "required": ["answer"], "additionalProperties": False}
    for seed in range(4):
        body = {**body, "seed": seed, "response_format": _json_schema(strict_schema)}
        response = await gateway.post("/v1/chat/completions", json=body, headers=headers)
        answer = await response.json()
        assert response.status == 200, answer
        choice = answer["choices"][0]
        if choice["finish_reason"] == "stop":
            assert set(json.loads(choice["message"]["content"])) == {"answer"}
    tools = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": LOOSE}}]
    response = await gateway.post(
        "/v1/chat/completions", json={**body, "response_format": None, "tools": tools}, headers=headers
    )
    answer = await response.json()
    assert response.status == 400 and answer["error"]["param"] == "tools[0].function.parameters", answer
