"""OpenAI compatibility through the real openai SDK: sampling parameters are honoured (logit_bias,
penalties, logprobs, n) or refused with a 400 naming them, unknown fields are logged once, and
x-request-id is echoed, in error bodies, logs and usage records."""

import json
import logging
import shutil

import openai
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel, Field
from sqlalchemy import select

from gateway.app import create_app
from gateway.model import template_renders_tool_calls, template_uses_tools
from gateway.state import SESSIONMAKER, USAGE_WRITER
from tenancy.models import UsageRecord
from tests.gateway.conftest import ADMIN, create_tenant, make_config
from tests.gateway.test_gateway_e2e import MODEL, unique_system_prompt
from tests.worker_process import worker_process
from worker.model.loader import BUILTIN_DIR
from worker.tokenizer import BYTE_CHAT_TEMPLATE

A, B = 65, 66  # byte-level tokenizer of the random-tiny model: token id = byte value


def messages() -> list[dict]:
    return [{"role": "system", "content": unique_system_prompt(20)}, {"role": "user", "content": "hi"}]


async def test_logit_bias_forces_a_token_and_frequency_penalty_breaks_the_repetition(sdk):
    forced = await sdk.chat.completions.create(
        model=MODEL, messages=messages(), max_tokens=8, temperature=0, logit_bias={str(A): 100}
    )
    assert forced.choices[0].message.content == "A" * 8
    # +8 makes "B" the greedy choice; 2 per occurrence overtakes it after a few tokens.
    penalised = await sdk.completions.create(
        model=MODEL,
        prompt=unique_system_prompt(5),
        max_tokens=12,
        temperature=0,
        logit_bias={str(B): 8},
        frequency_penalty=2.0,
        extra_body={"ignore_eos": True},
    )
    assert 0 < penalised.choices[0].text.count("B") < 12
    presence = await sdk.completions.create(
        model=MODEL,
        prompt=unique_system_prompt(5),
        max_tokens=12,
        temperature=0,
        logit_bias={str(B): 1.5},
        presence_penalty=2.0,
        extra_body={"ignore_eos": True},
    )
    assert presence.choices[0].text.count("B") <= 1


async def test_chat_logprobs_non_stream_and_stream(sdk):
    body = {
        "model": MODEL,
        "messages": messages(),
        "max_tokens": 4,
        "temperature": 0,
        "logit_bias": {str(A): 100},
    }
    answer = await sdk.chat.completions.create(**body, logprobs=True, top_logprobs=2)
    content = answer.choices[0].logprobs.content
    assert [entry.token for entry in content] == ["A"] * 4
    for entry in content:
        assert entry.bytes == [A] and -1e-3 < entry.logprob <= 0.0  # +100: near certain
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == "A"
    plain = await sdk.chat.completions.create(**body)
    assert plain.choices[0].logprobs is None

    stream = await sdk.chat.completions.create(**body, logprobs=True, stream=True)
    chunks = [chunk async for chunk in stream]
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == ["A"] * 4 and all(e.top_logprobs == [] for e in streamed)


async def test_completion_logprobs(sdk):
    answer = await sdk.completions.create(
        model=MODEL, prompt="hello", max_tokens=3, temperature=0, logprobs=2, logit_bias={str(B): 100}
    )
    logprobs = answer.choices[0].logprobs
    assert logprobs.tokens == ["B", "B", "B"] and logprobs.text_offset == [0, 1, 2]
    assert len(logprobs.token_logprobs) == 3 and all(len(top) == 2 for top in logprobs.top_logprobs)
    assert "B" in logprobs.top_logprobs[0]


async def test_n_choices_share_the_prompt_and_are_seeded(sdk):
    body = {
        "model": MODEL,
        "messages": messages(),
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 11,
        "extra_body": {"ignore_eos": True},
    }
    first = await sdk.chat.completions.create(**body, n=3)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert len(set(texts)) > 1  # seeds 11, 12, 13
    again = await sdk.chat.completions.create(**body, n=3)
    assert [c.message.content for c in again.choices] == texts
    one = await sdk.chat.completions.create(**body, n=1)
    assert first.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt is billed once
    assert first.usage.completion_tokens == 3 * 6

    stream = await sdk.chat.completions.create(
        **body, n=2, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    by_index: dict[int, str] = {0: "", 1: ""}
    finished = set()
    for chunk in chunks:
        for choice in chunk.choices:
            by_index[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    completions = await sdk.completions.create(model=MODEL, prompt="abc", n=2, max_tokens=3, seed=1)
    assert [c.index for c in completions.choices] == [0, 1]


async def test_n_choices_at_the_largest_seed_wrap_to_seed_zero(sdk):
    """Choice i's seed is (seed + i) mod 2**64: n=2 at seed 2**64-1 was a 500 (choice 1 got 2**64)."""
    body = {
        "model": MODEL,
        "messages": messages(),
        "max_tokens": 6,
        "temperature": 1.0,
        "extra_body": {"ignore_eos": True},
    }
    top = await sdk.chat.completions.create(**body, n=2, seed=2**64 - 1)
    last = await sdk.chat.completions.create(**body, n=1, seed=2**64 - 1)
    zero = await sdk.chat.completions.create(**body, n=1, seed=0)
    texts = [c.message.content for c in top.choices]
    assert texts == [last.choices[0].message.content, zero.choices[0].message.content]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
            "response_format",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "not_offered"}}}, "tool_choice"),
        ({"store": True}, "store"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"n": 9}, "n"),
        ({"top_logprobs": 3}, "top_logprobs"),
    ],
)
async def test_parameters_that_cannot_be_honoured_are_a_400_naming_them(sdk, extra, param):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"model": MODEL, "messages": messages(), "max_tokens": 2}
    if "tool_choice" in extra:
        body["tools"] = tools
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.chat.completions.create(**body, extra_body=extra)
    assert refused.value.param.startswith(param) and param in refused.value.message


async def test_unknown_fields_are_logged_once_per_name(sdk, caplog):
    caplog.set_level(logging.WARNING, logger="gateway.parameters")
    for _ in range(3):
        await sdk.chat.completions.create(
            model=MODEL, messages=messages(), max_tokens=1, extra_body={"frobnicate_level": 3}
        )
    lines = [r.getMessage() for r in caplog.records if "frobnicate_level" in r.getMessage()]
    assert len(lines) == 1 and "chat" in lines[0]


async def test_x_request_id_is_echoed_logged_and_billed(gateway, sdk, caplog):
    caplog.set_level(logging.INFO, logger="prefixgate.gateway.access")
    raw = await sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages(), max_tokens=2, extra_headers={"x-request-id": "client-42.a:b"}
    )
    assert raw.headers["x-request-id"] == "client-42.a:b"
    generated = await sdk.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=1)
    assert generated.headers["x-request-id"].startswith("req_")
    assert any("x-request-id=client-42.a:b" in r.getMessage() for r in caplog.records)

    stream = await sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages(), max_tokens=2, stream=True, extra_headers={"x-request-id": "s-1"}
    )
    assert stream.headers["x-request-id"] == "s-1"
    _ = [chunk async for chunk in stream.parse()]

    with pytest.raises(openai.NotFoundError) as missing:
        await sdk.chat.completions.create(
            model="nope", messages=messages(), extra_headers={"x-request-id": "err-7"}
        )
    assert missing.value.request_id == "err-7" and missing.value.body["request_id"] == "err-7"
    with pytest.raises(openai.BadRequestError) as invalid:
        await sdk.models.list(extra_headers={"x-request-id": "bad id with spaces"})
    assert invalid.value.param == "x-request-id"

    admin = await gateway.get("/admin/v1/tenants", headers={**ADMIN, "x-request-id": "adm-1"})
    assert admin.status == 200 and admin.headers["x-request-id"] == "adm-1"
    unknown_route = await gateway.get("/v1/nowhere")
    assert unknown_route.status == 404 and (await unknown_route.json())["error"]["request_id"].startswith(
        "req_"
    )
    assert unknown_route.headers["x-request-id"] == (await unknown_route.json())["error"]["request_id"]

    await gateway.app[USAGE_WRITER].flush()
    async with gateway.app[SESSIONMAKER]() as session:
        keys = list(await session.scalars(select(UsageRecord.request_id)))
    assert any(key.startswith("client-42.a:b#") for key in keys)
    assert generated.headers["x-request-id"] in keys


NO_TOOLS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def no_tools_worker_url(tmp_path_factory):
    """The built-in model behind a chat template without tools support (as SmolLM2's)."""
    model_dir = tmp_path_factory.mktemp("no-tools-model")
    for path in BUILTIN_DIR.iterdir():
        shutil.copy(path, model_dir / path.name)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": NO_TOOLS_TEMPLATE})
    )
    log_path = model_dir.parent / "worker.log"
    with worker_process("--model", str(model_dir), "--max-model-len", "1024", log_path=log_path) as url:
        yield url


async def test_tools_are_refused_by_a_template_without_tools_support(
    aiohttp_client, sqlite_url, tmp_path, no_tools_worker_url
):
    app = create_app(make_config(sqlite_url, tmp_path, worker_urls=(no_tools_worker_url,)))
    gateway = await aiohttp_client(app)
    key = (await create_tenant(gateway))["api_key"]
    client = AsyncOpenAI(base_url=str(gateway.make_url("/v1")), api_key=key, max_retries=0)
    model = (await client.models.list()).data[0].id
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model=model, messages=messages(), tools=tools, max_tokens=1)
    assert refused.value.param == "tools" and "does not support tools" in refused.value.message
    plain = await client.chat.completions.create(model=model, messages=messages(), max_tokens=1)
    assert plain.choices[0].finish_reason in ("stop", "length")
    # An earlier call in the history is dropped by this template too: refused, never rendered without it.
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [*messages(), {"role": "assistant", "content": None, "tool_calls": [call]}]
    history.append({"role": "tool", "tool_call_id": "call_1", "content": "done"})
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model=model, messages=history, max_tokens=1)
    assert refused.value.code == "unsupported_parameter" and refused.value.param == "messages[2].tool_calls"
    await client.close()
    assert template_uses_tools(BYTE_CHAT_TEMPLATE) and not template_uses_tools(NO_TOOLS_TEMPLATE)
    assert template_renders_tool_calls(BYTE_CHAT_TEMPLATE) and not template_renders_tool_calls(
        NO_TOOLS_TEMPLATE
    )


class City(BaseModel):
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=10**9)
    capital: bool


async def test_structured_output_parses_with_the_sdk_even_from_a_random_model(sdk):
    for seed in (1, 2):
        answer = await sdk.chat.completions.parse(
            model=MODEL, messages=messages(), response_format=City, max_tokens=300, seed=seed
        )
        city = answer.choices[0].message.parsed
        assert isinstance(city, City) and answer.choices[0].finish_reason == "stop"
    # json_object: any object; a random model may spend max_tokens inside one string (finish "length")
    anything = await sdk.chat.completions.create(
        model=MODEL, messages=messages(), response_format={"type": "json_object"}, max_tokens=40, seed=3
    )
    assert anything.choices[0].message.content.startswith("{")
