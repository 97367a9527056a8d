"""Model output that looks like a tool call but is malformed stays text: the answer is delivered (200,
a stream ends with [DONE]) and billed (hostile-input review, finding 3)."""

import json

import pytest
from sqlalchemy import select

from gateway.pipeline import RequestPipeline
from gateway.state import SESSIONMAKER, USAGE_WRITER
from gateway.tool_calls import HERMES, LLAMA3_JSON, ToolCallParser, ToolCallStream
from tenancy.models import UsageRecord
from tests.gateway.conftest import create_tenant
from tests.gateway.test_gateway_e2e import auth

BAD = '<tool_call>{"name": ["f"], "arguments": {}}</tool_call>'


@pytest.mark.parametrize(
    ("style", "text"),
    [
        (HERMES, BAD),
        (HERMES, '<tool_call>{"name": {"a": 1}, "arguments": {}}</tool_call>'),
        (HERMES, "<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>"),  # RecursionError in json
        (LLAMA3_JSON, '{"name": ["f"], "parameters": {}}'),
        (LLAMA3_JSON, '{"name": null, "parameters": {}}'),
    ],
)
def test_a_call_whose_name_is_not_a_string_stays_text(style, text):
    parser = ToolCallParser(style=style, names=frozenset({"f"}))
    assert parser.parse(text) == (text, [])
    stream = ToolCallStream(parser=parser)
    sent = stream.feed(text)
    assert sent + stream.finish()[0] == text and stream.finish()[1] == []


@pytest.fixture
def bad_tool_output(monkeypatch):
    """The real worker generates; only the answer's text is replaced by a malformed tool call (the
    random-tiny model cannot be steered to write one; a Hermes/Qwen model can be prompted to)."""
    generate, stream = RequestPipeline.generate, RequestPipeline.stream

    async def bad_generate(self, prepared):
        return {**(await generate(self, prepared)), "text": BAD}

    async def bad_stream(self, prepared):
        first = True
        async for event in stream(self, prepared):
            if "text" in event:  # the first delta, even one whose bytes are not yet text
                event = {**event, "text": BAD if first else ""}
                first = False
            yield event

    monkeypatch.setattr(RequestPipeline, "generate", bad_generate)
    monkeypatch.setattr(RequestPipeline, "stream", bad_stream)


async def _records(gateway) -> list[UsageRecord]:
    await gateway.app[USAGE_WRITER].flush()
    async with gateway.app[SESSIONMAKER]() as session:
        return list(await session.scalars(select(UsageRecord)))


@pytest.mark.parametrize("stream", [False, True])
async def test_a_malformed_tool_call_in_the_answer_is_delivered_as_text_and_billed(
    gateway, bad_tool_output, stream
):
    key = (await create_tenant(gateway))["api_key"]
    body = {
        "model": "random-tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": stream,
        # Seed 11: random-tiny's 5 tokens are all bytes of unfinished UTF-8 characters, so no event carries
        # text (about 1 random answer in 50): the fixture must replace the text of a stream that has none.
        "seed": 11,
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }
    response = await gateway.post("/v1/chat/completions", json=body, headers=auth(key))
    text = await response.text()
    assert response.status == 200, text
    if stream:
        events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", text[-300:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks), text[-500:]
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    else:
        message = json.loads(text)["choices"][0]["message"]
        assert not message.get("tool_calls")
        content = message["content"]
    assert content == BAD
    [record] = await _records(gateway)
    assert (record.status, record.outcome, record.completion_tokens) == (200, "completed", 5)
    assert record.prompt_tokens > 0


@pytest.fixture
def scripted_output(monkeypatch):
    """The real worker generates; the answer's text is replaced by ``script["text"]`` (streamed in one
    delta): the random-tiny model cannot be steered to write text before a tool call."""
    script = {"text": ""}
    generate, stream = RequestPipeline.generate, RequestPipeline.stream

    async def scripted_generate(self, prepared):
        return {**(await generate(self, prepared)), "text": script["text"]}

    async def scripted_stream(self, prepared):
        first = True
        async for event in stream(self, prepared):
            # The first delta, even one whose bytes are not yet text; the final event when no event had a
            # text field (the sampled tokens of random weights can decode to nothing).
            if "text" in event or (first and event.get("type") == "final"):
                event = {**event, "text": script["text"] if first else ""}
                first = False
            yield event

    monkeypatch.setattr(RequestPipeline, "generate", scripted_generate)
    monkeypatch.setattr(RequestPipeline, "stream", scripted_stream)
    return script


CALL = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("\n\n" + CALL, None),  # only a call: content is null, as OpenAI's
        ("Let me check.\n\n" + CALL, "Let me check."),
        ("  Let me check. \n" + CALL + "\n", "  Let me check."),
    ],
)
async def test_the_content_before_a_tool_call_is_the_same_streamed_or_not(
    sdk, scripted_output, text, content
):
    scripted_output["text"] = text
    request = {
        "model": "random-tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "extra_body": {"ignore_eos": True},
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }
    message = (await sdk.chat.completions.create(**request)).choices[0].message
    assert message.content == content and [c.function.name for c in message.tool_calls] == ["f"]
    chunks = [chunk async for chunk in await sdk.chat.completions.create(**request, stream=True)]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc.function.name for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert streamed == (content or "") and calls == ["f"]


@pytest.mark.parametrize("text", ["\n\n" + CALL, "Let me check.\n\n" + CALL, "a \n b \n", "x <tool_call> y"])
def test_any_split_of_a_streamed_answer_sends_what_the_whole_answer_holds(text):
    parser = ToolCallParser(style=HERMES, names=frozenset({"f"}))
    content, calls = parser.parse(text)
    stream = ToolCallStream(parser=parser)
    sent = "".join(stream.feed(char) for char in text)
    rest, streamed_calls = stream.finish()
    assert sent + rest == (content or "") and len(streamed_calls) == len(calls)
