"""The ``openai`` external upstream, against a real OpenAI-compatible server: a second prefixgate gateway
in front of a real bundled worker, which reports ``cached_tokens`` (so billing from the upstream's usage
is checked for real). A recording reverse proxy between the two shows what the front gateway sent
upstream (isolation field, model name, stream options); it forwards every byte both ways unchanged.

The real openai SDK is the client of the front gateway.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web
from openai import AsyncOpenAI

from gateway.app import create_app
from gateway.config import OpenAIUpstreamConfig
from gateway.state import CONFIG
from gateway.up import free_port
from tests.gateway.conftest import create_tenant, make_config
from tests.gateway.test_gateway_billing import parse_sse, wait_records
from tests.gateway.test_gateway_e2e import MODEL, auth, unique_system_prompt

SESSION = web.AppKey("session", aiohttp.ClientSession)
PUBLIC_MODEL = "up-tiny"  # the front gateway's name for the upstream's random-tiny


@dataclass
class Recorder:
    """Requests that reached the upstream through the proxy: (path, lower-cased headers, JSON body)."""

    seen: list[tuple[str, dict[str, str], dict[str, Any]]] = field(default_factory=list)

    def bodies(self, path: str = "/v1/chat/completions") -> list[dict[str, Any]]:
        return [body for seen_path, _, body in self.seen if seen_path == path]


def recording_proxy(target: str, recorder: Recorder) -> web.Application:
    """A reverse proxy to ``target`` that records each request and streams the answer back as is."""

    async def startup(app: web.Application) -> None:
        app[SESSION] = aiohttp.ClientSession(auto_decompress=False)

    async def cleanup(app: web.Application) -> None:
        await app[SESSION].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        seen_headers = {key.lower(): value for key, value in request.headers.items()}
        recorder.seen.append((request.path, seen_headers, orjson.loads(raw) if raw else {}))
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        async with request.app[SESSION].request(
            request.method, target + request.path_qs, data=raw, headers=headers
        ) as upstream:
            response = web.StreamResponse(status=upstream.status)
            response.content_type = upstream.content_type
            await response.prepare(request)
            async for data in upstream.content.iter_any():
                await response.write(data)
            await response.write_eof()
            return response

    app = web.Application()
    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


@dataclass
class Front:
    client: Any  # aiohttp TestClient of the front gateway
    recorder: Recorder
    upstream_gateway: Any  # the upstream prefixgate gateway (its own database)

    def sdk(self, key: str) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=str(self.client.make_url("/v1")), api_key=key, max_retries=0)


def front_app(
    sqlite_template: Path,
    data_dir: Path,
    *urls: str,
    flavour: str = "vllm",
    api_key: str,
    upstream: dict[str, Any] | None = None,
    **config: Any,
):
    """The front gateway: ``urls`` as one upstream serving ``PUBLIC_MODEL`` (``upstream``: more
    ``OpenAIUpstreamConfig`` fields; ``config``: more ``GatewayConfig`` fields)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(sqlite_template, data_dir / "front.db")
    fields = {"timeout_s": 60, "probe_interval_s": 0, **(upstream or {})}  # no probe among recorded requests
    upstream_config = OpenAIUpstreamConfig(
        name="pg-upstream",
        urls=urls,
        models=((PUBLIC_MODEL, MODEL),),
        flavour=flavour,
        api_key=api_key,
        **fields,
    )
    database_url = f"sqlite+aiosqlite:///{data_dir / 'front.db'}"
    changes = {"worker_urls": (), "openai_upstreams": (upstream_config,), **config}
    return create_app(make_config(database_url, data_dir, **changes))


@pytest.fixture
async def front(aiohttp_client, aiohttp_server, gateway, sqlite_template, tmp_path) -> Front:
    """Front gateway → recording proxy → upstream gateway → real worker."""
    recorder = Recorder()
    proxy = await aiohttp_server(recording_proxy(str(gateway.make_url("")).rstrip("/"), recorder))
    front_key = (await create_tenant(gateway, name="front-gateway"))["api_key"]
    app = front_app(sqlite_template, tmp_path / "front", str(proxy.make_url("/v1")), api_key=front_key)
    return Front(client=await aiohttp_client(app), recorder=recorder, upstream_gateway=gateway)


def messages(system: str, user: str = "hello") -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


async def test_auth_is_enforced_before_anything_goes_upstream(front):
    sdk = front.sdk("wrong-key")
    with pytest.raises(openai.AuthenticationError) as caught:
        await sdk.chat.completions.create(model=PUBLIC_MODEL, messages=messages("hi"), max_tokens=2)
    await sdk.close()
    assert caught.value.status_code == 401
    body = {"model": PUBLIC_MODEL, "messages": messages("hi")}
    response = await front.client.post("/v1/chat/completions", json=body)  # no key at all
    assert response.status == 401
    assert (await response.json())["error"]["type"] == "authentication_error"
    assert front.recorder.seen == []


async def test_chat_is_served_and_billed_from_the_upstreams_cached_tokens(front):
    tenant = await create_tenant(front.client, name="acme")
    sdk = front.sdk(tenant["api_key"])
    system = unique_system_prompt()
    first = await sdk.chat.completions.create(
        model=PUBLIC_MODEL, messages=messages(system), max_tokens=4, temperature=0
    )
    second = await sdk.chat.completions.create(
        model=PUBLIC_MODEL,
        messages=messages(system),
        max_tokens=4,
        temperature=0,
        extra_headers={"x-request-id": "support-ticket-42"},
    )
    await sdk.close()
    assert front.recorder.seen[-1][1]["x-request-id"] == "support-ticket-42"  # one id end to end
    assert first.model == PUBLIC_MODEL and first.id.startswith("chatcmpl-")
    assert first.choices[0].message.role == "assistant"
    assert first.usage.prompt_tokens > 64 and first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 64  # the upstream's prefix cache served the repeated head, and said so
    assert second.usage.model_extra["prefixgate"]["upstream"] == "pg-upstream"
    assert second.usage.model_extra["prefixgate"]["cached_tokens_reported"] is True
    rows = await wait_records(front.client, 2)
    assert [(r.outcome, r.status, r.model) for r in rows] == [("completed", 200, PUBLIC_MODEL)] * 2
    assert [(r.prompt_tokens, r.cached_tokens, r.completion_tokens) for r in rows] == [
        (u.prompt_tokens, u.prompt_tokens_details.cached_tokens, u.completion_tokens)
        for u in (first.usage, second.usage)
    ]
    assert rows[1].cost_cached_input > 0  # priced at the cached rate
    forwarded = front.recorder.bodies()
    assert [body["model"] for body in forwarded] == [MODEL, MODEL]
    assert forwarded[0]["messages"] == messages(system)


async def test_tenants_get_distinct_server_derived_cache_salts_that_clients_cannot_pick(front):
    keys = [(await create_tenant(front.client, name=name))["api_key"] for name in ("alpha", "beta")]
    system = unique_system_prompt()
    for key in (keys[0], keys[0], keys[1]):
        sdk = front.sdk(key)
        await sdk.chat.completions.create(
            model=PUBLIC_MODEL,
            messages=messages(system),
            max_tokens=2,
            prompt_cache_key="shared-key",
            extra_body={"cache_salt": "chosen-by-the-client", "user": "bob"},
        )
        await sdk.close()
    salts = [body["cache_salt"] for body in front.recorder.bodies()]
    assert salts[0] == salts[1] != salts[2]  # per tenant, stable
    assert "chosen-by-the-client" not in salts and all(len(salt) == 48 for salt in salts)
    for body in front.recorder.bodies():
        assert "prompt_cache_key" not in body and "user" not in body  # vllm flavour: the salt only
    # A tenant whose key is invalidated (epoch bump) gets a fresh namespace, so a fresh salt.
    from tests.gateway.conftest import ADMIN

    tenants = await (await front.client.get("/admin/v1/tenants", headers=ADMIN)).json()
    alpha = next(t for t in tenants["data"] if t["name"] == "alpha")
    response = await front.client.post(f"/admin/v1/tenants/{alpha['id']}/invalidate", headers=ADMIN)
    assert response.status == 200, await response.text()
    await asyncio.sleep(0.3)  # policy refresh (0.1 s)
    sdk = front.sdk(keys[0])
    await sdk.chat.completions.create(model=PUBLIC_MODEL, messages=messages(system), max_tokens=2)
    await sdk.close()
    assert front.recorder.bodies()[-1]["cache_salt"] not in salts


async def test_stream_relays_chunks_and_bills_the_final_usage(front):
    tenant = await create_tenant(front.client, name="acme")
    sdk = front.sdk(tenant["api_key"])
    system = unique_system_prompt()
    texts, usages = [], []
    for include_usage in (True, False):
        stream = await sdk.chat.completions.create(
            model=PUBLIC_MODEL,
            messages=messages(system),
            max_tokens=8,
            temperature=0,
            stream=True,
            **({"stream_options": {"include_usage": True}} if include_usage else {}),
        )
        chunks = [chunk async for chunk in stream]
        assert {c.model for c in chunks} == {PUBLIC_MODEL} and len({c.id for c in chunks}) == 1
        texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        usage_chunks = [c for c in chunks if c.usage is not None]
        usages.append(usage_chunks[-1].usage if usage_chunks else None)
        assert chunks[-1].choices == [] if include_usage else usage_chunks == []
    await sdk.close()
    assert usages[0] is not None and usages[0].completion_tokens >= 1
    for body in front.recorder.bodies():  # the upstream is always asked for usage
        assert body["stream"] is True and body["stream_options"]["include_usage"] is True
    rows = await wait_records(front.client, 2)
    assert [(r.outcome, r.status) for r in rows] == [("completed", 200)] * 2
    assert rows[0].prompt_tokens == usages[0].prompt_tokens
    assert rows[0].completion_tokens == usages[0].completion_tokens
    assert rows[1].prompt_tokens == rows[0].prompt_tokens and rows[1].cached_tokens >= 64


async def test_completions_endpoint(front):
    tenant = await create_tenant(front.client, name="acme")
    sdk = front.sdk(tenant["api_key"])
    result = await sdk.completions.create(model=PUBLIC_MODEL, prompt="The sky is", max_tokens=3)
    await sdk.close()
    assert result.model == PUBLIC_MODEL and result.object == "text_completion"
    assert result.usage.prompt_tokens > 0
    assert front.recorder.bodies("/v1/completions")[0]["model"] == MODEL
    rows = await wait_records(front.client, 1)
    assert rows[0].endpoint == "completions" and rows[0].prompt_tokens == result.usage.prompt_tokens


async def test_models_lists_the_upstream_models(front):
    tenant = await create_tenant(front.client, name="acme")
    sdk = front.sdk(tenant["api_key"])
    assert [m.id async for m in sdk.models.list()] == [PUBLIC_MODEL]
    assert (await sdk.models.retrieve(PUBLIC_MODEL)).id == PUBLIC_MODEL
    with pytest.raises(openai.NotFoundError):
        await sdk.chat.completions.create(model="nope", messages=messages("x"), max_tokens=2)
    await sdk.close()
    body = {"model": PUBLIC_MODEL, "messages": messages("x")}
    lint = await front.client.post("/v1/prompt-lint", json=body, headers=auth(tenant["api_key"]))
    assert lint.status == 400 and (await lint.json())["error"]["code"] == "unsupported_model"


async def test_upstream_4xx_keeps_its_message(front):
    tenant = await create_tenant(front.client, name="acme")
    sdk = front.sdk(tenant["api_key"])
    with pytest.raises(openai.BadRequestError) as caught:
        await sdk.chat.completions.create(model=PUBLIC_MODEL, messages=messages("x"), max_tokens=10**6)
    await sdk.close()
    error = caught.value.body
    assert "maximum context length" in error["message"] and error["code"] == "context_length_exceeded"
    rows = await wait_records(front.client, 1)
    assert (rows[0].status, rows[0].outcome, rows[0].prompt_tokens) == (400, "client_error", 0)


async def test_upstream_down_is_503_with_an_openai_error_body(aiohttp_client, sqlite_template, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    client = await aiohttp_client(front_app(sqlite_template, tmp_path / "front", dead, api_key="k"))
    tenant = await create_tenant(client, name="acme")
    sdk = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=tenant["api_key"], max_retries=0)
    with pytest.raises(openai.APIStatusError) as caught:
        await sdk.chat.completions.create(model=PUBLIC_MODEL, messages=messages("x"), max_tokens=2)
    await sdk.close()
    assert caught.value.status_code == 503
    assert caught.value.body["code"] == "upstream_unreachable"
    assert caught.value.body["request_id"] == caught.value.response.headers["x-request-id"]
    rows = await wait_records(client, 1)
    assert (rows[0].status, rows[0].outcome, rows[0].prompt_tokens) == (503, "server_error", 0)


async def test_upstream_5xx_is_502_and_bad_gateway_credentials_are_not_the_tenants_fault(
    aiohttp_client, aiohttp_server, gateway, sqlite_template, tmp_path
):
    # An upstream gateway with no worker answers 503: the front says 502 (the upstream failed).
    key = (await create_tenant(gateway, name="front-gateway"))["api_key"]
    database_url = gateway.app[CONFIG].database_url
    no_worker = await aiohttp_server(create_app(make_config(database_url, tmp_path / "up")))
    cases = [
        (str(no_worker.make_url("/v1")), key, "upstream_error"),
        (str(gateway.make_url("/v1")), "bad", "upstream_auth"),
    ]
    for index, (url, api_key, code) in enumerate(cases):
        client = await aiohttp_client(
            front_app(sqlite_template, tmp_path / f"front{index}", url, api_key=api_key)
        )
        tenant = await create_tenant(client, name="acme")
        sdk = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=tenant["api_key"], max_retries=0)
        with pytest.raises(openai.APIStatusError) as caught:
            await sdk.chat.completions.create(model=PUBLIC_MODEL, messages=messages("x"), max_tokens=2)
        await sdk.close()
        assert caught.value.status_code == 502 and caught.value.body["code"] == code
        assert caught.value.body["type"] == "upstream_error"


async def test_a_refused_url_is_skipped_for_the_next(aiohttp_client, gateway, sqlite_template, tmp_path):
    key = (await create_tenant(gateway, name="front-gateway"))["api_key"]
    dead = f"http://127.0.0.1:{free_port()}/v1"
    urls = (dead, str(gateway.make_url("/v1")))
    client = await aiohttp_client(front_app(sqlite_template, tmp_path / "front", *urls, api_key=key))
    tenant = await create_tenant(client, name="acme")
    sdk = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=tenant["api_key"], max_retries=0)
    for i in range(4):  # whatever the rendezvous order, each is served
        reply = await sdk.chat.completions.create(
            model=PUBLIC_MODEL, messages=messages(f"prompt {i}"), max_tokens=2
        )
        assert reply.usage.prompt_tokens > 0
    await sdk.close()


async def test_client_gone_mid_stream_is_recorded_once_as_an_estimate(front):
    """The upstream (a prefixgate gateway) reports usage only at the end of its stream: a client gone
    before that is billed an estimate, said so in the outcome: the prompt as characters / 4 (this
    front gateway has no tokenizer of the model) and one token per content chunk relayed."""
    tenant = await create_tenant(front.client, name="acme")
    system = unique_system_prompt()
    body = {
        "model": PUBLIC_MODEL,
        "messages": messages(system),
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    response = await front.client.post("/v1/chat/completions", json=body, headers=auth(tenant["api_key"]))
    assert response.status == 200
    received = b""
    while received.count(b"data: ") < 5:
        chunk = await asyncio.wait_for(response.content.readany(), 30)
        assert chunk, received
        received += chunk
    events = parse_sse(received.rsplit(b"\n\n", 1)[0])
    assert all(isinstance(e, dict) for e in events)
    num_received = sum(1 for e in events if e["choices"][0]["delta"].get("content"))
    response.close()
    rows = await wait_records(front.client, 1)
    await asyncio.sleep(0.5)
    rows = await wait_records(front.client, 2, timeout_s=0.5)
    assert [(r.outcome, r.status) for r in rows] == [("cancelled_estimated", 499)]
    assert rows[0].prompt_tokens == -(-(len(system) + len("hello")) // 4)
    assert num_received <= rows[0].completion_tokens < 3000
    assert rows[0].cost_total > 0


async def test_sdk_closing_a_stream_early_is_billed_by_the_gateways_tokenizer(
    aiohttp_client, gateway, sqlite_template, tmp_path, worker_url
):
    """The front gateway also runs a bundled worker of the upstream's model: the estimate of a cut
    stream's prompt is then its tokenizer's exact count (the upstream's own, for an uncut request)."""
    key = (await create_tenant(gateway, name="front-gateway"))["api_key"]
    url = str(gateway.make_url("/v1"))
    app = front_app(
        sqlite_template, tmp_path / "front", url, api_key=key, flavour="none", worker_urls=(worker_url,)
    )
    client = await aiohttp_client(app)
    tenant = await create_tenant(client, name="acme")
    sdk = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=tenant["api_key"], max_retries=0)
    system = unique_system_prompt()
    uncut = await sdk.chat.completions.create(model=PUBLIC_MODEL, messages=messages(system), max_tokens=1)
    stream = await sdk.chat.completions.create(
        model=PUBLIC_MODEL,
        messages=messages(system),
        max_tokens=3000,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    contents = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            contents.append(chunk.choices[0].delta.content)
        if len(contents) == 4:
            break
    await stream.close()
    await sdk.close()
    rows = await wait_records(client, 2)
    cut = rows[1]
    assert (cut.outcome, cut.status) == ("cancelled_estimated", 499)
    assert cut.prompt_tokens == uncut.usage.prompt_tokens  # the same tokenizer, the same count
    assert cut.cached_tokens == 0  # no discount that the upstream did not report
    assert 4 <= cut.completion_tokens < 3000


async def test_a_cut_streams_real_prompt_counts_against_the_token_limit(
    aiohttp_client, gateway, sqlite_template, tmp_path, worker_url
):
    """A stream the client cut before the upstream reported usage: its prompt is counted by the front
    gateway's tokenizer (about one token a character here), not the characters / 4 the limit checked.
    Before, the estimate stood in the tokens-per-minute window and the tenant's next request of the same
    size was let in; now the window holds the real count and refuses it."""
    key = (await create_tenant(gateway, name="front-gateway"))["api_key"]
    url = str(gateway.make_url("/v1"))
    app = front_app(
        sqlite_template, tmp_path / "front", url, api_key=key, flavour="none", worker_urls=(worker_url,)
    )
    client = await aiohttp_client(app)
    tenant = await create_tenant(client, name="acme", rate_limit_tpm=900)
    sdk = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=tenant["api_key"], max_retries=0)
    system = unique_system_prompt() + " " + "0123456789" * 60  # checked as ~170 tokens, ~660 by tokens
    stream = await sdk.chat.completions.create(
        model=PUBLIC_MODEL,
        messages=messages(system),
        max_tokens=100,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    num_contents = 0
    async for chunk in stream:
        num_contents += bool(chunk.choices and chunk.choices[0].delta.content)
        if num_contents == 4:
            break
    await stream.close()
    [cut] = await wait_records(client, 1)
    assert cut.outcome == "cancelled_estimated" and cut.prompt_tokens > 600
    with pytest.raises(openai.RateLimitError) as refused:  # ~170 + 100 more would pass the estimate's window
        await sdk.chat.completions.create(model=PUBLIC_MODEL, messages=messages(system), max_tokens=100)
    await sdk.close()
    assert refused.value.body["code"] == "rate_limit_exceeded"


async def test_canonicalization_reaches_the_upstreams_cache(front):
    """A tenant with canonicalization on: the timestamp leaves the prefix before it goes upstream, so
    the upstream's cache serves the second request's head although the clients' prompts differ."""
    key = (await create_tenant(front.client, name="canon", canonicalization="on"))["api_key"]
    rules = " ".join(f"Rule {i}: answer politely and check the order number twice." for i in range(20))
    template = "You are the assistant of Example Corp. Current time: {now}. " + rules
    replies = []
    for now in ("2026-11-29T14:03:22Z", "2026-11-29T14:05:47Z"):
        body = {"model": PUBLIC_MODEL, "messages": messages(template.format(now=now)), "max_tokens": 2}
        response = await front.client.post("/v1/chat/completions", json=body, headers=auth(key))
        assert response.status == 200, await response.text()
        assert response.headers["x-prefixgate-canonicalized"] == "1"
        replies.append(await response.json())
    forwarded = front.recorder.bodies()
    assert "14:0" not in forwarded[0]["messages"][0]["content"]  # moved out of the system prompt
    assert forwarded[0]["messages"][0] == forwarded[1]["messages"][0]
    second = replies[1]["usage"]
    assert second["prompt_tokens_details"]["cached_tokens"] >= second["prompt_tokens"] - 64


async def test_tenant_limits_hold_before_the_upstream_is_asked(front):
    capped = await create_tenant(front.client, name="capped", max_tokens_limit=3)
    sdk = front.sdk(capped["api_key"])
    with pytest.raises(openai.BadRequestError) as caught:
        await sdk.chat.completions.create(model=PUBLIC_MODEL, messages=messages("x"), max_tokens=10)
    assert caught.value.body["param"] == "max_tokens"
    reply = await sdk.chat.completions.create(
        model=PUBLIC_MODEL, messages=messages("x"), extra_body={"ignore_eos": True}
    )
    await sdk.close()
    assert reply.usage.completion_tokens == 3
    assert front.recorder.bodies()[-1]["max_tokens"] == 3  # the tenant's cap, sent upstream
    tight = await create_tenant(front.client, name="tight", rate_limit_tpm=50)
    sdk = front.sdk(tight["api_key"])
    with pytest.raises(openai.RateLimitError) as caught:
        await sdk.chat.completions.create(model=PUBLIC_MODEL, messages=messages("y" * 400), max_tokens=2)
    await sdk.close()
    assert caught.value.body["code"] == "tokens_exceeded"
    assert len(front.recorder.bodies()) == 1  # neither refusal reached the upstream


async def test_same_prompt_head_goes_to_the_same_url(
    aiohttp_client, aiohttp_server, gateway, sqlite_template, tmp_path
):
    """Two URLs of one upstream (two proxies to the same server): a tenant's prompts with the same head
    land on one URL (its cached prefix is there); different heads spread over both."""
    recorders = [Recorder(), Recorder()]
    target = str(gateway.make_url("")).rstrip("/")
    proxies = [await aiohttp_server(recording_proxy(target, recorder)) for recorder in recorders]
    key = (await create_tenant(gateway, name="front-gateway"))["api_key"]
    urls = [str(proxy.make_url("/v1")) for proxy in proxies]
    client = await aiohttp_client(front_app(sqlite_template, tmp_path / "front", *urls, api_key=key))
    sdk = AsyncOpenAI(
        base_url=str(client.make_url("/v1")),
        api_key=(await create_tenant(client, name="acme"))["api_key"],
        max_retries=0,
    )
    system = unique_system_prompt()
    for question in ("first question", "second question", "third question"):
        await sdk.chat.completions.create(
            model=PUBLIC_MODEL, messages=messages(system, question), max_tokens=1
        )
    assert sorted(len(r.bodies()) for r in recorders) == [0, 3]
    for _ in range(20):  # all on one URL by chance: 2^-19
        await sdk.chat.completions.create(
            model=PUBLIC_MODEL, messages=messages(unique_system_prompt()), max_tokens=1
        )
    await sdk.close()
    assert all(len(r.bodies()) >= 1 for r in recorders)


async def test_openai_flavour_sends_a_per_tenant_prompt_cache_key(
    aiohttp_client, aiohttp_server, gateway, sqlite_template, tmp_path
):
    recorder = Recorder()
    proxy = await aiohttp_server(recording_proxy(str(gateway.make_url("")).rstrip("/"), recorder))
    key = (await create_tenant(gateway, name="front-gateway"))["api_key"]
    url = str(proxy.make_url("/v1"))
    client = await aiohttp_client(
        front_app(sqlite_template, tmp_path / "f", url, flavour="openai", api_key=key)
    )
    for name in ("alpha", "beta"):
        tenant_key = (await create_tenant(client, name=name))["api_key"]
        sdk = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=tenant_key, max_retries=0)
        for cache_key in ("conversation-1", "conversation-1", None):
            extra = {"prompt_cache_key": cache_key} if cache_key else {}
            await sdk.chat.completions.create(
                model=PUBLIC_MODEL,
                messages=messages("x"),
                max_tokens=1,
                extra_body={**extra, "cache_salt": "client-salt"},
            )
        await sdk.close()
    sent = [body["prompt_cache_key"] for body in recorder.bodies()]
    assert all("cache_salt" not in body for body in recorder.bodies())
    assert sent[0] == sent[1] != sent[2]  # the client's key splits its own namespace
    assert sent[3] == sent[4] and set(sent[:3]).isdisjoint(sent[3:])  # never another tenant's value
    assert "conversation-1" not in sent
