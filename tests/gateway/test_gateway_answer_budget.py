"""A non-streamed answer is built whole in the gateway's memory: n choices × max_tokens × (1 + top
alternatives) per token. One tenant's request may not make the gateway hold hundreds of MiB (review r14 #1:
n=8, max_tokens 4000, top_logprobs 20 grew it by ~300 MiB, and a tenant may run 32 such at once), so such
a request is a 400 that says to stream; streamed, each chunk is written as it comes."""

from __future__ import annotations

import pytest
from openai import AsyncOpenAI, BadRequestError

from gateway.app import create_app
from tests.gateway.conftest import create_tenant, make_config
from tests.gateway.test_gateway_e2e import MODEL

MESSAGES = [{"role": "user", "content": "hi"}]


async def test_a_non_streamed_answer_over_the_budget_is_a_400_that_says_to_stream(
    aiohttp_client, sqlite_url, tmp_path, worker_url
):
    config = make_config(sqlite_url, tmp_path, worker_urls=(worker_url,), max_answer_units=10_000)
    client = await aiohttp_client(create_app(config))
    sdk = AsyncOpenAI(
        base_url=str(client.make_url("/v1")), api_key=(await create_tenant(client))["api_key"], max_retries=0
    )
    big = {"n": 4, "max_tokens": 200, "logprobs": True, "top_logprobs": 20}  # 4 × 200 × 21 = 16,800
    with pytest.raises(BadRequestError) as refused:
        await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, **big)
    error = refused.value.body
    assert error["param"] == "top_logprobs" and "stream" in error["message"], error
    with pytest.raises(BadRequestError) as refused:  # completions: the integer logprobs
        await sdk.completions.create(model=MODEL, prompt="hi", n=4, max_tokens=200, logprobs=5 * 4)
    assert refused.value.body["param"] == "logprobs"

    # Within the budget, or streamed, it is served.
    answer = await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, **{**big, "top_logprobs": 2})
    assert len(answer.choices) == 4  # 4 × 200 × 3 = 2,400
    stream = await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **big)
    assert [chunk async for chunk in stream]
    # A plain answer within the budget is served (4 × 2).
    plain = await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, n=4, max_tokens=2)
    assert len(plain.choices) == 4
    await sdk.close()
