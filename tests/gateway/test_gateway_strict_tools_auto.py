"""Strict tools under ``tool_choice: "auto"``: OpenAI guarantees that when the model calls a ``strict``
function its arguments match the function's schema. Only ``required`` and a named function were
constrained; ``auto`` let the model write any arguments. Now ``auto`` with a strict tool carries a grammar
that leaves text free (anything without a call's start) and constrains a call once it starts.

The grammar is checked where the worker applies it: the worker's own ``GrammarCompiler`` (llguidance)
on the byte tokenizer of ``random-tiny``, fed answers byte by byte as the worker feeds sampled tokens. A
random-weight model never writes ``<tool_call>`` of its own accord, so through the openai SDK and the real
worker the tests show what a client sees of the grammar then: text answered whole, streamed or not.
"""

from __future__ import annotations

import pytest

from gateway.schemas import parse_chat
from gateway.tool_calls import HERMES, LLAMA3_JSON, ToolCallParser, request_tools
from tests.gateway.test_gateway_compat_tools import NOOP, WEATHER, messages
from tests.gateway.test_gateway_e2e import MODEL
from worker.structured import GrammarCompiler
from worker.tokenizer import TokenizerBundle

STRICT_WEATHER = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
BYTES = TokenizerBundle.byte_level()
COMPILER = GrammarCompiler(BYTES, 259)
EOS = BYTES.eos_token_ids[0]
ASCII_ONLY = {str(byte): -100 for byte in range(128, 256)}


def grammar_of(tools, tool_choice="auto", style=HERMES, **extra):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": tools, **extra}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    request, _ = request_tools(parse_chat(body), style)
    return request.sampling.grammar


def feed(grammar, text: str) -> str:
    """``"end"`` when the worker would take every byte of ``text`` then the end of the answer; else
    where it would refuse the next byte."""
    matcher = COMPILER.matcher(grammar)
    for index, byte in enumerate(text.encode()):
        if not matcher.compute_logit_bias()[byte]:
            return f"refused after {text.encode()[:index].decode(errors='replace')!r}"
        matcher.consume_token(byte)
    return "end" if matcher.compute_logit_bias()[EOS] else "no end"


def hermes_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


@pytest.mark.parametrize("tool_choice", [None, "auto"])
def test_auto_with_a_strict_tool_leaves_text_free_and_constrains_a_hermes_call(tool_choice):
    grammar = grammar_of([STRICT_WEATHER, NOOP], tool_choice)
    assert grammar is not None  # main: None, nothing constrained
    for text in ("", "Sunny today.", "a < b, <tool_ and <tool_call no", "x" * 5000):
        assert feed(grammar, text) == "end", text[:40]
    valid = hermes_call("get_weather", '{"city": "Oslo", "days": 2}')
    assert feed(grammar, "Let me check.\n" + valid) == "end"
    assert feed(grammar, valid + "\n" + hermes_call("noop", '{"anything": [1]}')) == "end"  # not strict
    for bad in (
        hermes_call("get_weather", '{"town": "Oslo"}'),  # a property the schema does not have
        hermes_call("get_weather", '{"city": "Oslo", "days": 22}'),  # over its maximum
        hermes_call("get_weather", '{"city": "Oslo"}'),  # a required one missing
        hermes_call("launch", "{}"),  # not offered
        "<tool_call>\nnot json",
        valid + "\nand text after the call",
    ):
        assert feed(grammar, bad).startswith("refused"), bad


def test_auto_with_a_strict_tool_constrains_a_llama3_call():
    grammar = grammar_of([STRICT_WEATHER, NOOP], style=LLAMA3_JSON)
    assert feed(grammar, "Sunny today. {not a call}") == "end"
    call = '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}'
    assert feed(grammar, call) == "end"
    assert feed(grammar, call + '; {"name": "noop", "parameters": {}}') == "end"
    assert feed(grammar, '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 10}}').startswith(
        "refused"
    )
    assert feed(grammar, '  {"nam": 1}').startswith("refused")  # an answer starting "{" is a call


def test_without_a_strict_tool_auto_stays_unconstrained():
    assert grammar_of([WEATHER, NOOP]) is None
    assert grammar_of([STRICT_WEATHER], tool_choice="none") is None
    # A JSON response_format constrains the answer itself (hermes calls cannot start in it): as before.
    json_object = grammar_of([STRICT_WEATHER], response_format={"type": "json_object"})
    assert json_object == {"type": "json_object"}


@pytest.mark.parametrize("stream", [False, True])
async def test_auto_with_strict_tools_answers_text_through_the_sdk(sdk, stream):
    """The grammar holds back no text and ends nothing early: a text answer of max_tokens, streamed or
    not. (Text under a grammar is UTF-8, llguidance's ``.``; a random-weight model's bytes often are not,
    so its answers are kept to ASCII here.)"""
    args = dict(model=MODEL, messages=messages(), tools=[STRICT_WEATHER, NOOP], tool_choice="auto")
    args.update(max_tokens=300, temperature=0, logit_bias=ASCII_ONLY)
    if stream:
        chunks = [c async for c in await sdk.chat.completions.create(stream=True, **args)]
        assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
            "length"
        ]
    else:
        answer = await sdk.chat.completions.create(**args)
        assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason == "length"
        assert answer.usage.completion_tokens == 300
        text = answer.choices[0].message.content
    assert text and "<tool_call>" not in text


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}'
PARSER_NAMES = frozenset({"get_weather", "noop"})


@pytest.mark.parametrize("lead", ["\r", "\x0c", "\x0b", "\x1e", "\xa0", "\u2003"])
def test_text_the_llama3_grammar_leaves_free_never_parses_as_an_unchecked_call(lead):
    """r18: the grammar's text may start with any blank but " \\t\\n" then "{"; the parser stripped every
    Unicode blank, so an invalid strict call behind a "\\r" was free text to one and a call to the other."""
    invalid = lead + '{"name": "get_weather", "parameters": {"town": "Oslo", "days": 999}}'
    accepted = feed(grammar_of([STRICT_WEATHER, NOOP], style=LLAMA3_JSON), invalid)
    _, calls = ToolCallParser(style=LLAMA3_JSON, names=PARSER_NAMES).parse(invalid)
    assert accepted == "end" and calls == []


@pytest.mark.parametrize(
    ("style", "two_calls"),
    [
        (HERMES, hermes_call("get_weather", '{"city": "Oslo", "days": 2}') * 2),
        (LLAMA3_JSON, LLAMA_CALL + "; " + LLAMA_CALL),
    ],
)
def test_parallel_tool_calls_false_allows_one_call(style, two_calls):
    """r18: ``parallel_tool_calls: false`` means one call at most: the auto grammar refuses a second and
    the parser of an unconstrained answer keeps the first."""
    two_calls = two_calls.replace("</tool_call><tool_call>", "</tool_call>\n<tool_call>")
    assert feed(grammar_of([STRICT_WEATHER, NOOP], style=style), two_calls) == "end"
    assert (
        feed(grammar_of([STRICT_WEATHER, NOOP], style=style, parallel_tool_calls=False), two_calls) != "end"
    )
    _, loose = request_tools(
        parse_chat(
            {"model": MODEL, "messages": messages(), "tools": [WEATHER, NOOP], "parallel_tool_calls": False}
        ),
        style,
    )
    assert [call["function"]["name"] for call in loose.parse(two_calls)[1]] == ["get_weather"]


def test_an_escaped_quote_does_not_join_two_llama3_calls():
    """r18: the splitter read ``\\"`` as the end of a string, so two calls came back as text."""
    answer = '{"name": "get_weather", "parameters": {"city": "a\\"b", "days": 2}}; ' + (
        '{"name": "noop", "parameters": {}}'
    )
    assert feed(grammar_of([STRICT_WEATHER, NOOP], style=LLAMA3_JSON), answer) == "end"
    _, calls = ToolCallParser(style=LLAMA3_JSON, names=PARSER_NAMES).parse(answer)
    assert [call["function"]["name"] for call in calls] == ["get_weather", "noop"]
