"""End to end: the real gateway app in front of a real worker process (random-tiny model)."""

import asyncio
import json
import uuid

import aiohttp
import pytest

from gateway.state import USAGE_WRITER
from tests.gateway.conftest import ADMIN, create_tenant

MODEL = "random-tiny"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def unique_system_prompt(words: int = 60) -> str:
    """A long, unique prompt head: several full 16-token blocks that no other test sends."""
    tag = uuid.uuid4().hex
    return f"[{tag}] You are a careful assistant. " + " ".join(f"rule-{i}" for i in range(words))


def chat_body(system: str, user: str = "hello", **extra) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 4,
        "temperature": 0,
        **extra,
    }


async def chat(gateway, key: str, body: dict) -> dict:
    response = await gateway.post("/v1/chat/completions", json=body, headers=auth(key))
    assert response.status == 200, await response.text()
    return await response.json()


def cached(result: dict) -> int:
    return result["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_chat_completion_shape_and_cache_hit(gateway):
    key = (await create_tenant(gateway))["api_key"]
    body = chat_body(unique_system_prompt())
    first = await chat(gateway, key, body)
    assert first["object"] == "chat.completion" and first["model"] == MODEL
    assert first["choices"][0]["message"]["role"] == "assistant"
    assert first["choices"][0]["finish_reason"] in ("stop", "length")
    usage = first["usage"]
    assert cached(first) == 0 and usage["prompt_tokens"] > 64 and usage["completion_tokens"] <= 4
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    breakdown = usage["prefixgate"]
    assert set(breakdown["cached_tokens_by_tier"]) == {"l1", "l2", "l3", "remote"}
    assert breakdown["prefill_ms"] > 0 and "estimated_saved_prefill_ms" in breakdown
    assert breakdown["isolation"] == "namespace"

    second = await chat(gateway, key, body)
    assert cached(second) >= 64 and cached(second) % 16 == 0
    assert second["usage"]["prefixgate"]["cached_tokens_by_tier"]["l1"] == cached(second)
    assert second["usage"]["prefixgate"]["estimated_saved_prefill_ms"] > 0
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


async def test_isolation_between_tenants(gateway):
    a = (await create_tenant(gateway, name="a"))["api_key"]
    b = (await create_tenant(gateway, name="b"))["api_key"]
    d = (await create_tenant(gateway, name="d", isolation="dedicated", reserved_blocks=8))["api_key"]
    s1 = (await create_tenant(gateway, name="s1", isolation="shared"))["api_key"]
    s2 = (await create_tenant(gateway, name="s2", isolation="shared"))["api_key"]
    body = chat_body(unique_system_prompt())

    assert cached(await chat(gateway, a, body)) == 0
    assert cached(await chat(gateway, a, body)) > 0  # A reuses its own prefix
    assert cached(await chat(gateway, b, body)) == 0  # B sends A's exact prompt right after A: nothing
    assert cached(await chat(gateway, d, body)) == 0
    assert cached(await chat(gateway, s1, body)) == 0  # the shared pool never saw it either
    assert cached(await chat(gateway, s2, body)) > 0  # shared tenants share with each other
    assert cached(await chat(gateway, a, body)) > 0 and cached(await chat(gateway, b, body)) > 0


async def test_dedicated_quota_reaches_the_worker(gateway, worker_url):
    created = await create_tenant(gateway, name="ded", isolation="dedicated", reserved_blocks=24)
    await chat(gateway, created["api_key"], chat_body(unique_system_prompt()))
    async with aiohttp.ClientSession() as session, session.get(worker_url + "/v1/stats") as response:
        stats = await response.json()
    assert stats["reserved_blocks"].get(created["namespace_id"]) == 24


async def test_invalidate_makes_next_request_reuse_nothing(gateway):
    created = await create_tenant(gateway)
    body = chat_body(unique_system_prompt())
    await chat(gateway, created["api_key"], body)
    assert cached(await chat(gateway, created["api_key"], body)) > 0
    response = await gateway.post(f"/admin/v1/tenants/{created['id']}/invalidate", headers=ADMIN)
    assert response.status == 200
    assert cached(await chat(gateway, created["api_key"], body)) == 0
    assert cached(await chat(gateway, created["api_key"], body)) > 0


async def read_sse(response) -> list:
    events = []
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.mark.parametrize("include_usage", [True, False])
async def test_chat_stream(gateway, include_usage):
    key = (await create_tenant(gateway))["api_key"]
    body = chat_body(
        unique_system_prompt(),
        stream=True,
        max_tokens=6,
        ignore_eos=True,
        stream_options={"include_usage": include_usage},
    )
    response = await gateway.post("/v1/chat/completions", json=body, headers=auth(key))
    assert response.status == 200 and response.content_type == "text/event-stream"
    events = await read_sse(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "length"
    last = chunks[-1]
    assert "cached_tokens" in last["usage"]["prompt_tokens_details"]
    assert last["usage"]["completion_tokens"] == 6
    assert (last["choices"] == []) is include_usage
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    body.pop("stream"), body.pop("stream_options")
    assert text == (await chat(gateway, key, body))["choices"][0]["message"]["content"]


async def test_completions_and_models(gateway):
    key = (await create_tenant(gateway))["api_key"]
    prompt = unique_system_prompt()
    response = await gateway.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0},
        headers=auth(key),
    )
    result = await response.json()
    assert result["object"] == "text_completion" and isinstance(result["choices"][0]["text"], str)
    assert cached(result) == 0 and result["usage"]["prompt_tokens"] == len(prompt.encode()) + 1  # bytes + BOS
    stream = await gateway.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 3, "stream": True},
        headers=auth(key),
    )
    events = await read_sse(stream)
    assert events[-1] == "[DONE]" and cached(events[-2]) > 0
    models = await (await gateway.get("/v1/models", headers=auth(key))).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert (await gateway.get(f"/v1/models/{MODEL}", headers=auth(key))).status == 200
    assert (await gateway.get("/healthz")).status == 200


async def test_model_and_context_errors(gateway):
    key = (await create_tenant(gateway, max_tokens_limit=100))["api_key"]
    unknown = await gateway.post(
        "/v1/chat/completions", json={**chat_body("x"), "model": "gpt-9"}, headers=auth(key)
    )
    assert unknown.status == 404 and (await unknown.json())["error"]["code"] == "model_not_found"
    too_long = await gateway.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x" * 5000}, headers=auth(key)
    )
    assert too_long.status == 400 and (await too_long.json())["error"]["code"] == "context_length_exceeded"
    too_many = await gateway.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x" * 4000, "max_tokens": 99}, headers=auth(key)
    )
    assert too_many.status == 400 and (await too_many.json())["error"]["code"] == "context_length_exceeded"
    over_limit = await gateway.post(
        "/v1/chat/completions", json=chat_body("x", max_tokens=101), headers=auth(key)
    )
    assert over_limit.status == 400 and (await over_limit.json())["error"]["param"] == "max_tokens"
    bad_ids = await gateway.post(
        "/v1/completions", json={"model": MODEL, "prompt": [10**7]}, headers=auth(key)
    )
    assert bad_ids.status == 400


async def test_sampling_parameters_reach_the_worker(gateway):
    key = (await create_tenant(gateway))["api_key"]
    base = chat_body(
        unique_system_prompt(10),
        max_tokens=12,
        ignore_eos=True,
        temperature=1.0,
        top_p=0.9,
        seed=7,
        user="u-1",
        prompt_cache_key="conv-1",
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
    )
    one = (await chat(gateway, key, base))["choices"][0]["message"]["content"]
    assert (await chat(gateway, key, base))["choices"][0]["message"]["content"] == one  # seed is honoured
    stop = one[3:6]
    if stop.strip() and one.find(stop) == 3:
        stopped = await chat(gateway, key, {**base, "stop": [stop]})
        assert stopped["choices"][0]["message"]["content"] == one[:3]
        assert stopped["choices"][0]["finish_reason"] == "stop"


async def worker_running(worker_url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(worker_url + "/v1/stats") as response:
        stats = await response.json()
    return stats["num_running"] + stats["num_waiting"]


async def test_client_disconnect_cancels_worker_request(gateway, worker_url):
    key = (await create_tenant(gateway))["api_key"]
    body = chat_body(unique_system_prompt(), stream=True, max_tokens=3000, ignore_eos=True)
    response = await gateway.post("/v1/chat/completions", json=body, headers=auth(key))
    assert response.status == 200
    await response.content.readline()
    await response.content.readline()
    assert await worker_running(worker_url) >= 1
    response.close()  # the client goes away mid-stream
    for _ in range(100):
        if await worker_running(worker_url) == 0:
            break
        await asyncio.sleep(0.05)
    assert await worker_running(worker_url) == 0
    await gateway.app[USAGE_WRITER].flush()
    report = await (await gateway.get("/admin/v1/reports/usage", headers=ADMIN)).json()
    assert report["totals"]["errors"] == 1  # recorded with status 499 (client closed the request)


async def test_concurrent_requests(gateway, worker_url):
    key = (await create_tenant(gateway))["api_key"]
    system = unique_system_prompt()

    async def one(i: int) -> dict:
        body = chat_body(system, user=f"question {i}", max_tokens=3, stream=i % 2 == 0)
        response = await gateway.post("/v1/chat/completions", json=body, headers=auth(key))
        assert response.status == 200
        return await read_sse(response) if i % 2 == 0 else await response.json()

    results = await asyncio.gather(*(one(i) for i in range(16)))
    assert len(results) == 16 and await worker_running(worker_url) == 0
    from gateway.state import WORKER_POOL

    assert all(state.in_flight == 0 for state in gateway.app[WORKER_POOL].workers.values())


async def test_usage_records_and_report(gateway):
    created = await create_tenant(gateway)
    body = chat_body(unique_system_prompt())
    for _ in range(2):
        await chat(gateway, created["api_key"], body)
    bad = await gateway.post("/v1/chat/completions", json={"model": MODEL}, headers=auth(created["api_key"]))
    assert bad.status == 400
    await gateway.app[USAGE_WRITER].flush()
    report = await (
        await gateway.get("/admin/v1/reports/usage", params={"tenant_id": created["id"]}, headers=ADMIN)
    ).json()
    totals = report["totals"]
    assert totals["requests"] == 3 and totals["errors"] == 1
    assert totals["cached_tokens"] > 0 and 0 < totals["hit_rate"] < 1 and totals["saved_prefill_s"] > 0
    assert totals["completion_tokens"] == 8


async def test_prefix_affinity_across_two_workers(
    aiohttp_client,
    sqlite_url,
    tmp_path,
    worker_url,
    second_worker_url,
):
    from gateway.app import create_app
    from tests.gateway.conftest import make_config

    config = make_config(sqlite_url, tmp_path, worker_urls=(worker_url, second_worker_url))
    gateway = await aiohttp_client(create_app(config))
    key = (await create_tenant(gateway))["api_key"]
    for _ in range(6):  # each distinct prompt head goes back to the worker that cached it
        body = chat_body(unique_system_prompt(30))
        await chat(gateway, key, body)
        assert (
            cached(
                await chat(
                    gateway,
                    key,
                    {**body, "messages": [*body["messages"][:1], {"role": "user", "content": "other"}]},
                )
            )
            > 0
        )
    workers = (await (await gateway.get("/admin/v1/workers", headers=ADMIN)).json())["data"]
    assert all(w["healthy"] for w in workers) and len(workers) == 2
    assert all(w["stats"]["num_blocks_total"] == 4096 for w in workers)
