"""The ``openai`` external upstream against a real third-party server: ``transformers serve`` on the
built-in model exported as a Hugging Face checkpoint, offline (tests/upstreams.py).

transformers serve is strict (a field it does not know is a 422), reports ``usage`` without
``prompt_tokens_details`` (so ``cached_tokens`` is unreported: billed as 0, and said so) and ends a
stream without ``[DONE]``, with the usage on the finishing chunk: the gateway must cope with all three.
"""

from __future__ import annotations

import asyncio
import shutil

import openai
import pytest
from openai import AsyncOpenAI

from gateway.app import create_app
from gateway.config import OpenAIUpstreamConfig
from tests.gateway.conftest import create_tenant, make_config
from tests.gateway.test_gateway_billing import parse_sse, wait_records
from tests.gateway.test_gateway_e2e import auth

pytest.importorskip("transformers")

PUBLIC_MODEL = "tiny-hf"
MESSAGES = [
    {"role": "system", "content": "You are a careful assistant. " * 8},
    {"role": "user", "content": "Write a Python function that reverses a string."},
]


@pytest.fixture
async def front(aiohttp_client, sqlite_template, tmp_path, transformers_server):
    """A gateway whose only upstream is transformers serve (flavour none: it takes no cache_salt)."""
    shutil.copy(sqlite_template, tmp_path / "front.db")
    upstream = OpenAIUpstreamConfig(
        name="transformers",
        urls=(transformers_server.base_url,),
        models=((PUBLIC_MODEL, transformers_server.model_id),),
        flavour="none",
        timeout_s=120,
    )
    config = make_config(
        f"sqlite+aiosqlite:///{tmp_path / 'front.db'}", tmp_path, worker_urls=(), openai_upstreams=(upstream,)
    )
    return await aiohttp_client(create_app(config))


@pytest.fixture
async def direct(transformers_server):
    client = AsyncOpenAI(base_url=transformers_server.base_url, api_key="unused", max_retries=0, timeout=120)
    yield client
    await client.close()


def tenant_sdk(front, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(front.make_url("/v1")), api_key=key, max_retries=0, timeout=120)


async def test_chat_through_the_gateway_is_the_servers_answer_billed_from_its_usage(
    front, direct, transformers_server
):
    wanted = await direct.chat.completions.create(
        model=transformers_server.model_id, messages=MESSAGES, max_tokens=12, temperature=0
    )
    sdk = tenant_sdk(front, (await create_tenant(front, name="acme"))["api_key"])
    # A client-sent cache_salt never reaches the upstream (this one would answer 422 to it).
    reply = await sdk.chat.completions.create(
        model=PUBLIC_MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        extra_body={"cache_salt": "another-tenants-salt"},
    )
    with pytest.raises(openai.AuthenticationError):
        await tenant_sdk(front, "not-a-key").chat.completions.create(
            model=PUBLIC_MODEL, messages=MESSAGES, max_tokens=2
        )
    await sdk.close()
    assert reply.choices[0].message.content == wanted.choices[0].message.content
    assert reply.model == PUBLIC_MODEL
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        wanted.usage.prompt_tokens,
        wanted.usage.completion_tokens,
    )
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert usage.model_extra["prefixgate"]["cached_tokens_reported"] is False
    rows = await wait_records(front, 1)  # a refused key makes no record
    assert [(r.status, r.outcome) for r in rows] == [(200, "completed")]
    assert (rows[0].prompt_tokens, rows[0].cached_tokens, rows[0].completion_tokens) == (
        usage.prompt_tokens,
        0,
        usage.completion_tokens,
    )


async def test_stream_without_done_is_relayed_whole_with_a_usage_chunk(front, direct, transformers_server):
    wanted = await direct.chat.completions.create(
        model=transformers_server.model_id, messages=MESSAGES, max_tokens=12, temperature=0
    )
    sdk = tenant_sdk(front, (await create_tenant(front, name="acme"))["api_key"])
    stream = await sdk.chat.completions.create(
        model=PUBLIC_MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    await sdk.close()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == wanted.choices[0].message.content
    assert [c.usage is not None for c in chunks].count(True) == 1 and chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == wanted.usage.prompt_tokens
    rows = await wait_records(front, 1)
    assert (rows[0].outcome, rows[0].prompt_tokens, rows[0].completion_tokens) == (
        "completed",
        wanted.usage.prompt_tokens,
        wanted.usage.completion_tokens,
    )


async def test_the_servers_422_is_our_400_with_its_message(front):
    sdk = tenant_sdk(front, (await create_tenant(front, name="acme"))["api_key"])
    with pytest.raises(openai.BadRequestError) as caught:  # top_k: a vLLM extension it does not know
        await sdk.chat.completions.create(
            model=PUBLIC_MODEL, messages=MESSAGES, max_tokens=2, extra_body={"top_k": 3}
        )
    await sdk.close()
    assert "top_k" in caught.value.body["message"]
    assert caught.value.response.headers["x-request-id"] == caught.value.body["request_id"]


async def test_client_gone_mid_stream_is_recorded_once_as_an_estimate(front):
    """transformers serve reports usage only at the end of a stream: a cut one is billed an estimate."""
    tenant = await create_tenant(front, name="acme")
    body = {"model": PUBLIC_MODEL, "messages": MESSAGES, "max_tokens": 400, "stream": True}
    response = await front.post("/v1/chat/completions", json=body, headers=auth(tenant["api_key"]))
    assert response.status == 200
    received = b""
    while received.count(b"data: ") < 4:
        chunk = await asyncio.wait_for(response.content.readany(), 60)
        assert chunk, received
        received += chunk
    response.close()
    events = parse_sse(received.rsplit(b"\n\n", 1)[0])
    num_received = sum(1 for e in events if e["choices"] and e["choices"][0]["delta"].get("content"))
    await wait_records(front, 1)
    await asyncio.sleep(0.5)
    rows = await wait_records(front, 2, timeout_s=0.5)
    if num_received == 0:  # nothing with text reached the client yet (the stream may open with a role)
        assert [(r.outcome, r.status, r.prompt_tokens) for r in rows] == [("client_cancelled", 499, 0)]
        return
    assert [(r.outcome, r.status) for r in rows] == [("cancelled_estimated", 499)]
    num_chars = sum(len(m["content"]) for m in MESSAGES)
    assert rows[0].prompt_tokens == -(-num_chars // 4) and rows[0].completion_tokens >= num_received


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
async def test_the_token_limit_counts_what_the_upstream_reports_not_the_estimate(front, stream):
    """The tokens-per-minute check of an external upstream's request can only estimate the prompt
    (characters / 4), and the estimate stood: this server's tokenizer makes about one token of every
    character, so a tenant with a 1000-token limit was served 6 requests of ~610 real tokens in a minute.
    Now the window is corrected with the upstream's usage when the answer (or the stream) ends: a request
    is admitted only while what the earlier ones really used is under the limit."""
    limit, max_tokens = 1000, 2
    tenant = await create_tenant(front, name="tight", rate_limit_tpm=limit)
    sdk = tenant_sdk(front, tenant["api_key"])
    content = "0123456789" * 60  # 600 characters: an estimate of 150 tokens
    used: list[int] = []  # what each served request counts, by the upstream's own usage
    with pytest.raises(openai.RateLimitError) as refused:
        for _ in range(8):
            messages = [{"role": "user", "content": content}]
            if stream:
                chunks = await sdk.chat.completions.create(
                    model=PUBLIC_MODEL,
                    messages=messages,
                    max_tokens=max_tokens,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                usage = [chunk async for chunk in chunks][-1].usage
            else:
                reply = await sdk.chat.completions.create(
                    model=PUBLIC_MODEL, messages=messages, max_tokens=max_tokens
                )
                usage = reply.usage
            assert usage.prompt_tokens > 600  # the estimate was a quarter of it
            used.append(usage.prompt_tokens + max_tokens)
    await sdk.close()
    assert refused.value.body["code"] == "rate_limit_exceeded"
    assert sum(used[:-1]) <= limit, used  # each request was let in while the real count had room
