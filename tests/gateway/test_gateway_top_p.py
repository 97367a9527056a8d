"""``top_p: 0`` is honoured (review r6 #6): OpenAI accepts it (the smallest nucleus: the most likely
token) and docs/api.md promises every value in OpenAI's range, but the worker refused it ("top_p must
be in (0, 1]"), as vLLM and SGLang do. The gateway sends it as ``SMALLEST_TOP_P``, the same nucleus of
one token, to the bundled worker and to external upstreams alike."""

from __future__ import annotations

from gateway.schemas import SMALLEST_TOP_P
from tests.gateway.conftest import create_tenant
from tests.gateway.test_gateway_upstream_openai import PUBLIC_MODEL, front, messages  # noqa: F401 - fixture


async def test_top_p_zero_is_served_as_the_most_likely_token(sdk):
    answer = await sdk.completions.create(model="random-tiny", prompt="hello", max_tokens=4, top_p=0)
    assert answer.choices[0].finish_reason in ("stop", "length")
    greedy = await sdk.completions.create(model="random-tiny", prompt="hello", max_tokens=8, temperature=0)
    for seed in (1, 2, 3):  # sampling at temperature 2 from a nucleus of one: always the argmax
        sampled = await sdk.completions.create(
            model="random-tiny", prompt="hello", max_tokens=8, temperature=2, top_p=0, seed=seed
        )
        assert sampled.choices[0].text == greedy.choices[0].text


async def test_chat_top_p_zero_is_served(sdk):
    answer = await sdk.chat.completions.create(
        model="random-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, top_p=0.0
    )
    assert answer.choices[0].finish_reason in ("stop", "length")


async def test_top_p_zero_reaches_an_external_upstream_as_the_smallest_nucleus(front):  # noqa: F811
    """vLLM and SGLang refuse 0 too: the upstream gets ``SMALLEST_TOP_P``; other values go unchanged."""
    sdk = front.sdk((await create_tenant(front.client, name="acme"))["api_key"])
    for top_p in (0, 0.5):
        answer = await sdk.chat.completions.create(
            model=PUBLIC_MODEL, messages=messages("hi"), max_tokens=2, top_p=top_p
        )
        assert answer.choices[0].finish_reason in ("stop", "length")
    await sdk.close()
    assert [body["top_p"] for body in front.recorder.bodies()] == [SMALLEST_TOP_P, 0.5]
