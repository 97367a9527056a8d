"""The official openai SDK works unchanged against the gateway (base_url=…/v1), streaming included."""

import openai
import pytest
from openai import AsyncOpenAI

from tests.gateway.test_gateway_e2e import MODEL, unique_system_prompt


async def test_sdk_chat_non_stream_and_stream(sdk):
    messages = [{"role": "system", "content": unique_system_prompt()}, {"role": "user", "content": "hi"}]
    first = await sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    assert first.choices[0].message.role == "assistant"
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.usage.model_extra["prefixgate"]["cached_tokens_by_tier"]["l1"] == 0

    stream = await sdk.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert chunks[-1].usage.completion_tokens == 5 and isinstance(text, str)


async def test_sdk_completions_models_and_errors(sdk):
    completion = await sdk.completions.create(model=MODEL, prompt=unique_system_prompt(), max_tokens=3)
    assert completion.usage.prompt_tokens_details.cached_tokens == 0
    stream = await sdk.completions.create(model=MODEL, prompt="hello there", max_tokens=3, stream=True)
    assert len([chunk async for chunk in stream]) >= 1
    assert [m.id async for m in sdk.models.list()] == [MODEL]

    with pytest.raises(openai.NotFoundError) as not_found:
        await sdk.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        await sdk.completions.create(model=MODEL, prompt="x" * 5000)
    assert too_long.value.code == "context_length_exceeded"
    bad_key = AsyncOpenAI(base_url=str(sdk.base_url), api_key="sk-pg-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad_key.models.list()
    await bad_key.close()
