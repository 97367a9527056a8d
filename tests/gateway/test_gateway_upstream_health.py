"""Faults of an external upstream's URLs (gateway.upstream_health): a dead or hanging URL among several
must not slow every request routed to it, and one tenant's hanging streams must not hold the
connections another tenant needs.

The bad URLs are real kernel sockets, no scripted server (the one aiohttp server below is a healthy URL
that takes long over long generations): a listening socket whose accept queue is full
drops new SYNs (a connect timeout, as a black-holed host), and one that is listening but never reads
accepts the TCP connection and never answers (a hung server). The good URL is a real prefixgate gateway
in front of a real worker, behind the recording proxy of test_gateway_upstream_openai; the client is the
openai SDK.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import aiohttp
import openai
import pytest
from aiohttp import web
from openai import AsyncOpenAI

from gateway.app import create_app
from gateway.config import OpenAIUpstreamConfig
from gateway.errors import Unavailable
from gateway.state import CONFIG, UPSTREAMS
from gateway.up import free_port
from gateway.upstream_health import OPEN
from gateway.upstream_openai import OpenAIUpstream
from tests.gateway.conftest import ADMIN, create_tenant
from tests.gateway.test_gateway_e2e import MODEL, unique_system_prompt
from tests.gateway.test_gateway_upstream_openai import (
    PUBLIC_MODEL,
    Recorder,
    front_app,
    messages,
    recording_proxy,
)
from tests.upstreams import blackhole, hung_server

# Unique prompts spread over two URLs by rendezvous hashing: with this many, fewer than 3 put the bad URL
# first has probability 30·29/2 · 2^-30 + … < 1e-6.
NUM_REQUESTS = 30


async def _front(aiohttp_client, aiohttp_server, gateway, sqlite_template, tmp_path, bad: str, **upstream):
    recorder = Recorder()
    proxy = await aiohttp_server(recording_proxy(str(gateway.make_url("")).rstrip("/"), recorder))
    key = (await create_tenant(gateway, name="front-gateway"))["api_key"]
    good = str(proxy.make_url("/v1"))
    app = front_app(sqlite_template, tmp_path / "front", bad, good, api_key=key, upstream=upstream)
    client = await aiohttp_client(app)
    tenant_key = (await create_tenant(client, name="acme"))["api_key"]
    sdk = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=tenant_key, max_retries=0)
    return client, sdk, recorder, good


async def _metrics(client) -> str:
    return await (await client.get("/metrics", headers=ADMIN)).text()


def _gauge(upstream: str, url: str, value: float) -> str:
    return f'prefixgate_upstream_url_healthy{{upstream="{upstream}",url="{url}"}} {value}'


async def test_a_url_that_times_out_connecting_fails_over_and_is_skipped_once_its_breaker_opens(
    aiohttp_client, aiohttp_server, gateway, sqlite_template, tmp_path
):
    with blackhole() as dead:
        client, sdk, recorder, good = await _front(
            aiohttp_client, aiohttp_server, gateway, sqlite_template, tmp_path, dead,
            connect_timeout_s=0.3, down_s=600, failure_threshold=2,
        )  # fmt: skip
        for _ in range(NUM_REQUESTS):  # every one is served: a connect timeout never started the request
            reply = await sdk.chat.completions.create(
                model=PUBLIC_MODEL, messages=messages(unique_system_prompt()), max_tokens=1
            )
            assert reply.usage.prompt_tokens > 0
        await sdk.close()
        health = client.app[UPSTREAMS].upstreams[0].health.snapshot()
        metrics = await _metrics(client)
    assert len(recorder.bodies()) == NUM_REQUESTS  # all on the good URL
    # Only the first two requests that ranked the dead URL first paid its connect timeout: the breaker
    # then opened and the others skipped it (no further failure was counted).
    assert health[dead]["state"] == OPEN and health[dead]["times_opened"] == 1
    assert health[dead]["consecutive_failures"] == 2
    assert health[dead]["last_error"] == "ConnectionTimeoutError"
    assert health[good]["state"] == "closed"
    assert _gauge("pg-upstream", dead, 0.0) in metrics and _gauge("pg-upstream", good, 1.0) in metrics


async def test_a_hung_url_is_opened_by_the_probe_not_by_the_requests_that_time_out_there(
    aiohttp_client, aiohttp_server, gateway, sqlite_template, tmp_path
):
    """A request sent to a hung URL times out (it may have run there: not retried elsewhere), yet does
    not count against the URL: from the request alone a hung server and a long generation look the same.
    The probe (``GET /models`` within ``connect_timeout_s``, here called as ``probe_forever`` does) opens
    it, and no request goes there afterwards."""
    with hung_server() as hung:
        client, sdk, recorder, _ = await _front(
            aiohttp_client, aiohttp_server, gateway, sqlite_template, tmp_path, hung,
            timeout_s=1, connect_timeout_s=0.3, down_s=600, failure_threshold=2,
        )  # fmt: skip
        upstream = client.app[UPSTREAMS].upstreams[0]

        async def ask() -> object:
            try:
                await sdk.chat.completions.create(
                    model=PUBLIC_MODEL, messages=messages(unique_system_prompt()), max_tokens=1
                )
                return 200
            except openai.APIStatusError as exc:
                return (exc.status_code, exc.body["code"])

        codes = []
        while codes.count((503, "upstream_timeout")) < 3:  # more than failure_threshold of them
            assert len(codes) < NUM_REQUESTS, codes
            codes.append(await ask())
        assert upstream.health.snapshot()[hung]["consecutive_failures"] == 0
        assert upstream.health.state(hung) == "closed"
        for _ in range(2):
            assert not await upstream.probe(hung)
        served = len(recorder.bodies())
        after = [await ask() for _ in range(10)]
        await sdk.close()
        health = upstream.health.snapshot()
    assert set(codes) <= {200, (503, "upstream_timeout")}
    assert after == [200] * 10 and len(recorder.bodies()) == served + 10
    assert health[hung]["state"] == OPEN and health[hung]["last_error"] == "probe: TimeoutError"


def _slow_for_long_generations(name: str, hits: list[tuple[str, int]]) -> web.Application:
    """An upstream that answers short requests at once and works 5 s on a long generation."""

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        hits.append((name, body["max_tokens"]))
        if body["max_tokens"] > 1000:
            await asyncio.sleep(5)
        message = {"role": "assistant", "content": "hi"}
        return web.json_response({
            "id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        })  # fmt: skip

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def test_one_tenants_long_generations_do_not_open_the_url_for_other_tenants(aiohttp_server):
    """Tenant A's non-streamed generations outlive ``timeout_s`` on a healthy URL: A gets its timeouts,
    but the URL's breaker stays closed, so tenant B's next request still goes to its rendezvous URL
    (where its prefix cache is) and is answered there."""
    hits: list[tuple[str, int]] = []
    first = await aiohttp_server(_slow_for_long_generations("first", hits))
    second = await aiohttp_server(_slow_for_long_generations("second", hits))
    urls = [str(first.make_url("/v1")), str(second.make_url("/v1"))]
    config = OpenAIUpstreamConfig(
        name="up", urls=tuple(urls), models=(("m", "m"),), timeout_s=0.5, failure_threshold=2,
        probe_interval_s=0,
    )  # fmt: skip

    def body(max_tokens: int) -> dict[str, object]:
        return {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": max_tokens}

    async with aiohttp.ClientSession() as session:
        upstream = OpenAIUpstream(config, session)
        for _ in range(3):  # tenant A, more than failure_threshold times
            with pytest.raises(Unavailable) as caught:
                async with upstream._open(urls, "/chat/completions", body(100000), "tenant-a"):
                    pass
            assert caught.value.code == "upstream_timeout"
        assert hits == [("first", 100000)] * 3  # each ran there: not retried on the other URL
        assert upstream.health.snapshot()[urls[0]]["consecutive_failures"] == 0
        hits.clear()
        async with upstream._open(urls, "/chat/completions", body(5), "tenant-b") as response:
            assert response.status == 200
    assert hits == [("first", 5)]
    assert upstream.health.state(urls[0]) == "closed"


async def test_when_every_url_is_open_they_are_tried_anyway(
    aiohttp_client, aiohttp_server, gateway, sqlite_template, tmp_path
):
    """One URL, refusing: its breaker opens, yet the next request still tries it, so the upstream is
    served again as soon as it is back (no request is refused for the breaker alone)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    key = (await create_tenant(gateway, name="front-gateway"))["api_key"]
    app = front_app(
        sqlite_template,
        tmp_path / "front",
        url,
        api_key=key,
        upstream={"down_s": 600, "failure_threshold": 1},
    )
    client = await aiohttp_client(app)
    tenant_key = (await create_tenant(client, name="acme"))["api_key"]
    sdk = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=tenant_key, max_retries=0)
    health = client.app[UPSTREAMS].upstreams[0].health
    for _ in range(2):
        with pytest.raises(openai.APIStatusError) as caught:
            await sdk.chat.completions.create(model=PUBLIC_MODEL, messages=messages("x"), max_tokens=1)
        assert caught.value.status_code == 503 and caught.value.body["code"] == "upstream_unreachable"
        assert health.state(url) == OPEN
    assert health.snapshot()[url]["consecutive_failures"] == 2  # the open URL was tried again
    recorder = Recorder()
    await aiohttp_server(recording_proxy(str(gateway.make_url("")).rstrip("/"), recorder), port=port)
    reply = await sdk.chat.completions.create(model=PUBLIC_MODEL, messages=messages("x"), max_tokens=1)
    await sdk.close()
    assert reply.usage.prompt_tokens > 0 and len(recorder.bodies()) == 1
    assert health.state(url) == "closed"
    assert _gauge("pg-upstream", url, 1.0) in await _metrics(client)


async def test_the_active_probe_opens_a_hung_urls_breaker_before_any_request_pays(
    aiohttp_client, aiohttp_server, gateway, sqlite_template, tmp_path
):
    with hung_server() as hung:
        client, sdk, recorder, good = await _front(
            aiohttp_client, aiohttp_server, gateway, sqlite_template, tmp_path, hung,
            timeout_s=30, connect_timeout_s=0.3, down_s=600, failure_threshold=2, probe_interval_s=0.1,
        )  # fmt: skip
        health = client.app[UPSTREAMS].upstreams[0].health
        deadline = time.monotonic() + 20
        while health.state(hung) != OPEN:
            assert time.monotonic() < deadline, health.snapshot()
            await asyncio.sleep(0.05)
        assert health.snapshot()[hung]["last_error"] == "probe: TimeoutError"
        for _ in range(10):  # none of these pays the hung URL's 30 s timeout
            reply = await sdk.chat.completions.create(
                model=PUBLIC_MODEL, messages=messages(unique_system_prompt()), max_tokens=1
            )
            assert reply.usage.prompt_tokens > 0
        await sdk.close()
        assert health.state(good) == "closed"
        probes = [path for path, _, _ in recorder.seen if path == "/v1/models"]
    assert probes and len(recorder.bodies()) == 10  # the good URL is probed too, and served them all


async def test_one_tenants_hanging_streams_do_not_hold_the_connections_another_needs(
    aiohttp_client, aiohttp_server, gateway, sqlite_template, tmp_path
):
    """Tenant A opens more hanging streams than aiohttp's default connection-pool limit (100) to a
    hung upstream; tenant B's requests to another upstream of the same gateway (one client session)
    are still served while they hang: A's connections queue nobody."""
    num_hanging = 120
    recorder = Recorder()
    proxy = await aiohttp_server(recording_proxy(str(gateway.make_url("")).rstrip("/"), recorder))
    key = (await create_tenant(gateway, name="front-gateway"))["api_key"]
    with hung_server() as hung:
        hung_upstream = OpenAIUpstreamConfig(
            name="hung",
            urls=(hung,),
            models=(("hung-model", MODEL),),
            timeout_s=60,
            failure_threshold=10**6,
            probe_interval_s=0,
        )
        app = front_app(
            sqlite_template, tmp_path / "front", str(proxy.make_url("/v1")), api_key=key,
        )  # fmt: skip
        config = app[CONFIG]
        app = create_app(replace(config, openai_upstreams=(*config.openai_upstreams, hung_upstream)))
        client = await aiohttp_client(app)
        key_a = (await create_tenant(client, name="tenant-a"))["api_key"]
        key_b = (await create_tenant(client, name="tenant-b"))["api_key"]
        sdk_b = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key_b, max_retries=0)
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        url = str(client.make_url("/v1/chat/completions"))

        async def hang(i: int) -> str:
            body = {"model": "hung-model", "messages": messages(f"a{i}"), "stream": True, "max_tokens": 4}
            async with session.post(url, json=body, headers={"Authorization": f"Bearer {key_a}"}) as r:
                return f"{r.status} {await r.text()}"

        hanging: list[asyncio.Task[str]] = []
        try:
            deadline = time.monotonic() + 60
            while len(hanging) < num_hanging:  # in bursts the gateway's CPU queue (64) takes
                hanging += [asyncio.create_task(hang(len(hanging) + i)) for i in range(20)]
                while _hung_connections(hung) < len(hanging):  # each waits on the hung server
                    done = [t.exception() or t.result() for t in hanging if t.done()]
                    assert time.monotonic() < deadline and not done, (_hung_connections(hung), done[:3])
                    await asyncio.sleep(0.05)
            for _ in range(5):
                reply = await asyncio.wait_for(
                    sdk_b.chat.completions.create(
                        model=PUBLIC_MODEL, messages=messages(unique_system_prompt()), max_tokens=1
                    ),
                    timeout=30,
                )
                assert reply.usage.prompt_tokens > 0
            assert not any(task.done() for task in hanging)  # A's streams still hold their connections
        finally:
            for task in hanging:
                task.cancel()
            await asyncio.gather(*hanging, return_exceptions=True)
            await session.close()
            await sdk_b.close()
    assert len(recorder.bodies()) == 5


def _hung_connections(url: str) -> int:
    """Established TCP connections to the hung URL's port (from /proc/net/tcp: state 01)."""
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    count = 0
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            remote, state = fields[2], fields[3]
            if state == "01" and int(remote.split(":")[1], 16) == port:
                count += 1
    return count
