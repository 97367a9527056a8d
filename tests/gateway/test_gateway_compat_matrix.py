"""docs/api.md's compatibility matrix: every OpenAI parameter (gateway.parameters) sent through the real
openai SDK, honoured values answered (200) and rejected values refused with a 400 naming the parameter.

The table in the docs is generated from the same rows; the test fails when it drifts. Regenerate with
``PREFIXGATE_UPDATE_DOCS=1 pytest tests/gateway/test_gateway_compat_matrix.py``.
"""

import os
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from gateway.parameters import CHAT, COMPLETIONS, PARAMETERS, Parameter
from tests.gateway.test_gateway_e2e import MODEL

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
START, END = "<!-- compat-matrix:start -->", "<!-- compat-matrix:end -->"
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
IMAGE = [
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}
]

# parameter -> (a value that must be honoured, a value that must be refused); None: no such value
SAMPLES: dict[str, tuple[Any, Any]] = {
    "model": (MODEL, None),
    "messages": ([{"role": "user", "content": "hi"}], IMAGE),
    "prompt": ("hi", ["one", "two"]),
    "max_tokens": (2, None),
    "max_completion_tokens": (2, None),
    "temperature": (0.5, None),
    "top_p": (0.9, None),
    "top_k": (5, None),
    "seed": (7, None),
    "stop": (["\n"], None),
    "n": (2, None),
    "stream": (True, None),
    "stream_options": ({"include_usage": True}, None),
    "presence_penalty": (0.5, None),
    "frequency_penalty": (0.5, None),
    "logit_bias": ({"65": 1}, None),
    "logprobs": (None, None),  # per endpoint below
    "top_logprobs": (2, None),
    "user": ("user-1", None),
    "safety_identifier": ("hash-1", None),
    "prompt_cache_key": ("conversation-1", None),
    "ignore_eos": (True, None),
    "tools": ([TOOL], None),
    "tool_choice": ("required", {"type": "function", "function": {"name": "not_offered"}}),
    "parallel_tool_calls": (False, None),
    "response_format": (
        {
            "type": "json_schema",
            "json_schema": {"name": "n", "schema": {"type": "object", "maxProperties": 0}},
        },
        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "nonsense"}}},
    ),
    "metadata": ({"team": "a"}, None),
    "store": (False, True),
    "service_tier": ("auto", "flex"),
    "modalities": (["text"], ["text", "audio"]),
    "audio": (None, {"voice": "alloy", "format": "wav"}),
    "prediction": (None, {"type": "content", "content": "x"}),
    "web_search_options": (None, {}),
    "reasoning_effort": (None, "low"),
    "verbosity": (None, "low"),
    "functions": (None, [{"name": "lookup", "parameters": {"type": "object"}}]),
    "function_call": (None, "auto"),
    "echo": (False, True),
    "suffix": (None, "tail"),
    "best_of": (1, 3),
}
LOGPROBS = {CHAT: (True, None), COMPLETIONS: (2, None)}


def samples(parameter: Parameter, endpoint: str) -> tuple[Any, Any]:
    return LOGPROBS[endpoint] if parameter.name == "logprobs" else SAMPLES[parameter.name]


def matrix_markdown() -> str:
    rows = [
        "| parameter | chat | completions | honoured | answered with a 400 whose `param` names it |",
        "|---|---|---|---|---|",
    ]
    for p in PARAMETERS:
        chat = "✓" if CHAT in p.endpoints else "—"
        completions = "✓" if COMPLETIONS in p.endpoints else "—"
        rows.append(f"| `{p.name}` | {chat} | {completions} | {p.honoured or '—'} | {p.rejected or '—'} |")
    return "\n".join(rows)


def test_every_parameter_has_samples_and_the_docs_show_the_matrix():
    assert {p.name for p in PARAMETERS} == set(SAMPLES)
    for p in PARAMETERS:  # a row that says it honours or refuses something is checked below
        for endpoint in p.endpoints:
            honoured, refused = samples(p, endpoint)
            assert (honoured is not None) == bool(p.honoured), p.name
            assert (refused is not None) == bool(p.rejected) or p.name in ("messages", "prompt", "tools"), (
                p.name
            )
    text = DOC.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    generated = f"{head}{START}\n{matrix_markdown()}\n{END}{tail}"
    if os.environ.get("PREFIXGATE_UPDATE_DOCS") == "1":
        DOC.write_text(generated)
        text = generated
    assert START in text and text == generated, "docs/api.md's matrix is stale: regenerate (see docstring)"


def _body(endpoint: str, name: str, value: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if endpoint == CHAT else {"prompt": "hi"}
    if name == "stream_options" or (name == "tool_choice" or name == "parallel_tool_calls"):
        body |= {"stream": True} if name == "stream_options" else {"tools": [TOOL]}
    if name == "top_logprobs":
        body["logprobs"] = True
    if name == "best_of" and value == 1:
        body["n"] = 1
    body[name] = value
    return body


async def _send(client: AsyncOpenAI, endpoint: str, body: dict[str, Any]) -> None:
    named = {key: body.pop(key) for key in ("model", "stream") if key in body}
    create = client.chat.completions.create if endpoint == CHAT else client.completions.create
    extra = {"messages": body.pop("messages")} if endpoint == CHAT else {"prompt": body.pop("prompt")}
    if endpoint == CHAT:
        answer = await create(**named, messages=extra["messages"], extra_body=body)
    else:
        answer = await create(**named, prompt=extra["prompt"], extra_body=body)
    if named.get("stream"):
        assert [chunk async for chunk in answer]
    else:
        assert answer.choices


CASES = [(p, endpoint) for p in PARAMETERS for endpoint in sorted(p.endpoints)]


async def test_each_row_through_the_openai_sdk(sdk):
    """One SDK call per (parameter, endpoint, honoured/refused) sample: what the matrix says happens."""
    checked = 0
    for parameter, endpoint in CASES:
        honoured, refused = samples(parameter, endpoint)
        if honoured is not None:
            await _send(sdk, endpoint, _body(endpoint, parameter.name, honoured))
            checked += 1
        if refused is not None:
            with pytest.raises(openai.BadRequestError) as error:
                await _send(sdk, endpoint, _body(endpoint, parameter.name, refused))
            assert error.value.param is not None and error.value.param.startswith(parameter.name), parameter
            checked += 1
    assert checked >= 60
