"""Hot-prefix promotion end to end: real gateway, real SQLite, real worker, low thresholds."""

import asyncio
import time

import pytest

from gateway.app import create_app
from gateway.state import POLICY_CACHE
from tests.gateway.conftest import ADMIN, create_tenant, make_config
from tests.gateway.test_gateway_canonicalization import system_with
from tests.gateway.test_gateway_e2e import auth, cached, chat_body


@pytest.fixture
async def gateway(aiohttp_client, sqlite_url, tmp_path, worker_url):
    config = make_config(
        sqlite_url, tmp_path, worker_urls=(worker_url,), promotion_min_hits=3, promotion_min_tenants=3
    )
    return await aiohttp_client(create_app(config))


async def ask(gateway, key: str, system: str, user: str) -> dict:
    response = await gateway.post("/v1/chat/completions", json=chat_body(system, user), headers=auth(key))
    assert response.status == 200, await response.text()
    return await response.json()


def promoted_tokens(result: dict) -> int:
    return result["usage"]["prefixgate"]["promoted_prefix_tokens"]


async def hot_prefixes(gateway, **query) -> list[dict]:
    response = await gateway.get("/admin/v1/hot-prefixes", params=query, headers=ADMIN)
    assert response.status == 200
    return (await response.json())["data"]


async def wait_for_hot_prefixes(gateway, count: int, timeout_s: float = 3.0) -> list[dict]:
    """Promotions reach SQL off the request path: wait for the background write."""
    deadline = time.monotonic() + timeout_s
    while len(rows := await hot_prefixes(gateway)) != count:
        assert time.monotonic() < deadline, rows
        await asyncio.sleep(0.05)
    return rows


async def tenant(gateway, name: str, **fields) -> str:
    return (await create_tenant(gateway, name=name, **fields))["api_key"]


async def test_three_opted_in_tenants_promote_a_shared_system_prompt(gateway):
    system = system_with("the day of the launch")  # about 1,700 tokens, the same for every tenant
    a, b, c, d = [await tenant(gateway, name, share_hot_prefixes=True) for name in "abcd"]
    outsider = await tenant(gateway, "outsider")  # did not opt in
    dedicated = await tenant(gateway, "dedicated", isolation="dedicated", share_hot_prefixes=True)

    # Neither the outsider nor the dedicated tenant feeds the counters: after them and two opted-in
    # tenants there are 2 tenants and 2 hits, below both thresholds.
    for key, user in ((outsider, "o"), (dedicated, "x"), (a, "question a"), (b, "question b")):
        assert promoted_tokens(await ask(gateway, key, system, user)) == 0
    assert await hot_prefixes(gateway) == []

    promoting = await ask(gateway, c, system, "question c")  # third tenant: counted once served
    assert promoted_tokens(promoting) == 0  # the request completing the count learns nothing
    (row,) = await wait_for_hot_prefixes(gateway, 1)
    promoted = row["num_tokens"]
    assert promoted > 1600 and promoted % 16 == 0

    fourth = await ask(gateway, d, system, "question d")  # its very first request: makes the shared copy
    assert promoted_tokens(fourth) == 0  # d did not help promote it, so it is never told
    again = await ask(gateway, a, system, "question a again")  # a contributed before the promotion
    assert promoted_tokens(again) == promoted
    assert cached(again) >= promoted
    assert again["usage"]["prefixgate"]["cached_tokens_by_tier"]["l1"] == cached(again)

    # Not opted in / dedicated: nothing from the global copy, ever.
    for name, fields in (
        ("late-outsider", {}),
        ("late-dedicated", {"isolation": "dedicated", "share_hot_prefixes": True}),
    ):
        result = await ask(gateway, await tenant(gateway, name, **fields), system, "hello")
        assert cached(result) == 0 and promoted_tokens(result) == 0

    assert row["num_tokens"] == promoted and row["num_tenants"] == 3 and row["hits_per_hour"] >= 3
    assert len(row["prefix_hash"]) == 64 and row["model"] == "random-tiny" and row["revoked"] is False
    assert set(row) == {
        "id", "object", "prefix_hash", "model", "num_tokens", "hits_per_hour", "num_tenants",
        "promoted_at", "revoked_at", "revoked",
    }  # fmt: skip
    shown = await (await gateway.get(f"/admin/v1/hot-prefixes/{row['id']}", headers=ADMIN)).json()
    assert shown["text"] is None  # hashes only, unless the deployment opts in to storing text

    metrics = await (await gateway.get("/metrics", headers=ADMIN)).text()
    assert "prefixgate_hot_prefix_promotions_total 1.0" in metrics
    assert "prefixgate_hot_prefixes 1.0" in metrics
    assert 'prefixgate_promoted_prefix_tokens_total{tenant="' in metrics


async def test_one_tenant_alone_never_promotes(gateway):
    system = system_with("a private prompt")
    key = await tenant(gateway, "loner", share_hot_prefixes=True)
    for i in range(8):
        result = await ask(gateway, key, system, f"question {i}")
        assert promoted_tokens(result) == 0
    assert cached(result) > 1600  # it does reuse its own copy
    await asyncio.sleep(0.2)
    assert await hot_prefixes(gateway, include_revoked="true") == []


async def test_revoked_prefix_is_private_again_and_not_promoted_back(gateway):
    system = system_with("a revoked prompt")
    keys = [await tenant(gateway, f"r{i}", share_hot_prefixes=True) for i in range(3)]
    for i, key in enumerate(keys):
        await ask(gateway, key, system, f"q{i}")
    (row,) = await wait_for_hot_prefixes(gateway, 1)

    revoked = await gateway.delete(f"/admin/v1/hot-prefixes/{row['id']}", headers=ADMIN)
    assert revoked.status == 200 and (await revoked.json())["revoked"] is True
    assert await hot_prefixes(gateway) == []
    assert [r["id"] for r in await hot_prefixes(gateway, include_revoked="true")] == [row["id"]]
    assert gateway.app[POLICY_CACHE].promoted_hashes == frozenset()

    newcomer = await tenant(gateway, "newcomer", share_hot_prefixes=True)
    first = await ask(gateway, newcomer, system, "q")
    assert promoted_tokens(first) == 0 and cached(first) == 0
    for i, key in enumerate(keys):  # counted again, but a revoked hash is known: no new promotion
        assert promoted_tokens(await ask(gateway, key, system, f"again {i}")) == 0
    await asyncio.sleep(0.2)
    assert await hot_prefixes(gateway) == []

    missing = await gateway.delete("/admin/v1/hot-prefixes/hp_nope", headers=ADMIN)
    assert missing.status == 404


async def test_boundary_prefixes_are_found_off_the_event_loop(gateway, monkeypatch):
    """Matching a prompt against promoted prefixes renders the whole prompt again and hashes every
    block: it ran on the event loop, where a long prompt stalled every tenant."""
    import threading

    from gateway import promotion

    threads: list[int] = []
    find = promotion.prompt_boundary_prefixes

    def recorded(*args):
        threads.append(threading.get_ident())
        return find(*args)

    monkeypatch.setattr(promotion, "prompt_boundary_prefixes", recorded)
    key = await tenant(gateway, "off-loop", share_hot_prefixes=True)
    await ask(gateway, key, system_with("a prompt with boundaries"), "question")
    assert threads and threading.get_ident() not in threads


@pytest.mark.parametrize("withdrawal", ["opt_out", "delete"])
async def test_a_withdrawn_tenant_no_longer_counts_towards_a_promotion(gateway, withdrawal):
    """Review r17 D6: a tenant that opted out or was deleted still counted as one of the k tenants for the
    rest of the hour, so two others promoted a prefix only they and it had sent: they learnt that a
    tenant no longer opted in had sent it."""
    system = system_with(f"the confidential plan ({withdrawal})")
    victim = await create_tenant(gateway, name="victim", share_hot_prefixes=True)
    b, c, d = [await tenant(gateway, name, share_hot_prefixes=True) for name in "bcd"]
    await ask(gateway, victim["api_key"], system, "question v")  # counted while opted in
    path = f"/admin/v1/tenants/{victim['id']}"
    if withdrawal == "opt_out":
        answer = await gateway.patch(path, json={"share_hot_prefixes": False}, headers=ADMIN)
    else:
        answer = await gateway.delete(path, headers=ADMIN)
    assert answer.status == 200, await answer.text()
    await ask(gateway, b, system, "question b")
    await ask(gateway, c, system, "question c")  # two tenants still opted in: below k = 3
    await asyncio.sleep(0.5)  # promotions are written in the background
    assert await hot_prefixes(gateway) == []
    await ask(gateway, d, system, "question d")  # the third opted-in tenant
    (row,) = await wait_for_hot_prefixes(gateway, 1)
    assert row["num_tenants"] == 3
