"""Tool calls: parsed from Hermes/Qwen and Llama-3 JSON answers into OpenAI ``tool_calls``, and
``tool_choice`` required/named enforced by constrained decoding (through the real openai SDK)."""

import itertools
import json

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import InvalidRequest
from gateway.model import compile_chat_template
from gateway.schemas import parse_chat
from gateway.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    ToolCallParser,
    ToolCallStream,
    request_tools,
    template_tool_style,
)
from tests.gateway.test_gateway_e2e import MODEL, unique_system_prompt
from worker.tokenizer import BYTE_CHAT_TEMPLATE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "days": {"type": "integer", "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
NOOP = {"type": "function", "function": {"name": "noop"}}
NAMES = frozenset({"get_weather", "noop"})


def test_styles_follow_the_chat_template():
    assert template_tool_style("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}") == HERMES
    llama = '{{- "<|python_tag|>" }}{{ "ipython" }} {"name": ..., "parameters": ...}'
    assert template_tool_style(llama) == LLAMA3_JSON
    assert template_tool_style("{% if tools %}{{ tools | tojson }}{% endif %}") == HERMES


def test_hermes_answers_are_parsed():
    parser = ToolCallParser(style=HERMES, names=NAMES)
    text = (
        "Let me check.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
        '\n<tool_call>{"name": "noop", "arguments": {}}</tool_call>'
    )
    content, calls = parser.parse(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "noop"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "days": 2}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    for not_a_call in (
        "plain answer",
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not offered
        '<tool_call>{"name": "noop", "arguments": </tool_call>',  # broken JSON
    ):
        assert parser.parse(not_a_call) == (not_a_call, [])


def test_llama3_json_answers_are_parsed():
    parser = ToolCallParser(style=LLAMA3_JSON, names=NAMES)
    content, calls = parser.parse(
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "a;b", "days": 1}}'
    )
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "a;b", "days": 1}
    _, two = parser.parse('{"name": "noop", "parameters": {}}; {"name": "noop", "parameters": {}}')
    assert len(two) == 2
    assert parser.parse("The weather is fine.") == ("The weather is fine.", [])


def test_streamed_text_is_held_back_only_where_a_call_may_start():
    stream = ToolCallStream(parser=ToolCallParser(style=HERMES, names=NAMES))
    assert stream.feed("Sure, <tool") == "Sure,"  # the space may lead into a call: held with it
    assert stream.feed("bar> is not a call") == " <toolbar> is not a call"
    assert stream.feed('<tool_call>{"name": "noop", ') == ""
    assert stream.feed('"arguments": {}}</tool_call>') == ""
    text, calls = stream.finish()
    assert text == "" and calls[0]["function"]["name"] == "noop"


def messages() -> list[dict]:
    return [{"role": "system", "content": unique_system_prompt(10)}, {"role": "user", "content": "weather?"}]


@pytest.mark.parametrize("seed", [1, 2])
async def test_required_tool_choice_always_gives_a_valid_call(sdk, seed):
    answer = await sdk.chat.completions.create(
        model=MODEL,
        messages=messages(),
        tools=[WEATHER, NOOP],
        tool_choice="required",
        seed=seed,
        max_tokens=200,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) == {"city", "days"} and len(arguments["city"]) <= 10 and arguments["days"] <= 9
    else:
        assert call.function.name == "noop" and arguments == {}


async def test_named_tool_choice_streams_that_call(sdk):
    stream = await sdk.chat.completions.create(
        model=MODEL,
        messages=messages(),
        tools=[WEATHER, NOOP],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        stream=True,
        seed=4,
        max_tokens=200,
    )
    chunks = [chunk async for chunk in stream]
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in calls] == ["get_weather"]
    assert set(json.loads(calls[0].function.arguments)) == {"city", "days"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"
    ]


async def test_auto_leaves_free_text_alone_and_bad_choices_are_400(sdk):
    answer = await sdk.chat.completions.create(
        model=MODEL, messages=messages(), tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert answer.choices[0].message.tool_calls is None and isinstance(answer.choices[0].message.content, str)
    with pytest.raises(openai.BadRequestError) as unknown:
        await sdk.chat.completions.create(
            model=MODEL,
            messages=messages(),
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "launch"}},
        )
    assert unknown.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError) as no_tools:
        await sdk.chat.completions.create(model=MODEL, messages=messages(), tool_choice="required")
    assert no_tools.value.param == "tool_choice"


leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.text(max_size=6)
    | st.sampled_from(["object", "string", "integer", "array", "get_weather", "#/$defs/x", "^(a|b)*$"])
)
schema_keys = st.sampled_from(["type", "properties", "items", "anyOf", "$ref", "pattern", "enum", "required"])
json_like = st.recursive(
    leaves,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(schema_keys | st.text(max_size=4), c, max_size=3),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(
    parameters=json_like,
    name=st.sampled_from(["get_weather", "", 7]),
    tool_choice=st.sampled_from(["auto", "none", "required"]) | json_like,
    response_format=json_like,
)
def test_tool_and_schema_handling_ends_in_a_request_or_a_400(parameters, name, tool_choice, response_format):
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": name, "parameters": parameters}}],
        "tool_choice": tool_choice,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": response_format}},
    }
    for candidate in (body, {**body, "response_format": None}):
        try:
            request_tools(parse_chat(candidate), HERMES)
        except InvalidRequest as exc:
            assert exc.param and exc.message


TWO_TOOLS = [
    WEATHER,
    {
        "type": "function",
        "function": {
            "name": "delete_account",
            "description": "Delete the user's account for good",
            "parameters": {
                "type": "object",
                "properties": {"user": {"type": "string"}},
                "required": ["user"],
            },
        },
    },
]


def agent_history(system: str, name: str, arguments: str) -> list[dict]:
    call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": "Do what is needed for me please."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]


async def test_earlier_tool_calls_are_part_of_the_prompt(sdk):
    """Review r3 D2: two histories that called different tools must not render to one prompt (the second
    was served the first one's KV and the model never saw which call it had made)."""
    system = unique_system_prompt()
    weather = agent_history(system, "get_weather", '{"city": "Paris"}')
    deletion = agent_history(system, "delete_account", '{"user": "alice"}')
    args = dict(model=MODEL, tools=TWO_TOOLS, max_tokens=1, temperature=0)
    first = await sdk.chat.completions.create(messages=weather, **args)
    second = await sdk.chat.completions.create(messages=deletion, **args)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached < second.usage.prompt_tokens // 16 * 16, (first.usage, second.usage)


def test_the_builtin_template_renders_calls_in_its_own_tool_style():
    history = agent_history("sys", "get_weather", '{"city": "Paris"}')
    text = compile_chat_template(BYTE_CHAT_TEMPLATE).render(messages=history, tools=[WEATHER], bos_token="")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert f"<|start|>assistant\n{call}<|end|>" in text
    assert "<|start|>tool call_1\ndone<|end|>" in text
    content, calls = ToolCallParser(style=HERMES, names=frozenset({"get_weather"})).parse(call)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


PIECES = [
    "hello",
    " ",
    "\n",
    "<tool",
    "<tool_call>",
    "</tool_call>",
    '{"name": "noop", "parameters": {}}',
    '{"name": "noop", "arguments": {}}',
    "; ",
    "<|python_tag|>",
    "{",
]


def _whole_and_streamed(style: str, pieces: list[str], cuts: list[int]) -> tuple:
    parser = ToolCallParser(style=style, names=NAMES)
    text = "".join(pieces)
    content, calls = parser.parse(text)
    stream = ToolCallStream(parser=parser)
    ends = [sum(map(len, pieces[: i + 1])) for i in range(len(pieces))]  # each piece a delta, and cuts
    bounds = sorted({0, *ends, *(c % (len(text) + 1) for c in cuts), len(text)})
    sent = "".join(stream.feed(text[a:b]) for a, b in itertools.pairwise(bounds))
    rest, streamed_calls = stream.finish()
    names = [[c["function"]["name"] for c in found] for found in (calls, streamed_calls)]
    return (content or "", names[0]), (sent + rest, names[1])


@pytest.mark.parametrize(
    ("style", "deltas"),
    [(LLAMA3_JSON, ["hello\n", '{"name": "noop", "parameters": {}}']), (LLAMA3_JSON, ["hi ", "{"])],
)
def test_text_then_json_is_not_a_llama3_call_streamed_or_not(style, deltas):
    whole, streamed = _whole_and_streamed(style, deltas, [len(deltas[0])])
    assert whole == streamed and whole[1] == []


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([HERMES, LLAMA3_JSON]),
    st.lists(st.sampled_from(PIECES), max_size=6),
    st.lists(st.integers(min_value=0, max_value=400), max_size=4),
)
def test_streamed_and_whole_answers_agree(style, pieces, cuts):
    whole, streamed = _whole_and_streamed(style, pieces, cuts)
    assert streamed == whole
