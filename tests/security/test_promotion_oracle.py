"""Hot-prefix promotion is not a membership oracle (issue 11).

The attack: an attacker holding k−1 opted-in tenants pads the counters for a guessed system prompt and
watches ``usage.prefixgate.promoted_prefix_tokens`` to learn whether a victim tenant sent it.
"""

import asyncio

import pytest
from sqlalchemy import text

from gateway.app import create_app
from gateway.state import ENGINE
from policies.promotion import PromotionPolicy
from tests.gateway.conftest import create_tenant, make_config
from tests.gateway.test_gateway_canonicalization import system_with
from tests.gateway.test_gateway_e2e import auth, cached, chat_body
from tests.gateway.test_gateway_promotion import hot_prefixes, wait_for_hot_prefixes


@pytest.fixture
async def gateway(aiohttp_client, sqlite_url, tmp_path, worker_url):
    config = make_config(
        sqlite_url, tmp_path, worker_urls=(worker_url,), promotion_min_hits=3, promotion_min_tenants=3
    )
    return await aiohttp_client(create_app(config))


async def key(gateway, name: str, **fields) -> str:
    return (await create_tenant(gateway, name=name, share_hot_prefixes=True, **fields))["api_key"]


async def ask(gateway, api_key: str, system: str, user: str, **extra):
    return await gateway.post(
        "/v1/chat/completions", json=chat_body(system, user, **extra), headers=auth(api_key)
    )


async def served(gateway, api_key: str, system: str, user: str) -> dict:
    response = await ask(gateway, api_key, system, user)
    assert response.status == 200, await response.text()
    return await response.json()


def promoted_tokens(result: dict) -> int:
    return result["usage"]["prefixgate"]["promoted_prefix_tokens"]


async def settle() -> None:
    await asyncio.sleep(0.3)  # counting happens after a request is served, off the request path


async def test_requests_that_are_not_served_whole_do_not_count(gateway):
    """Padding with requests the attackers cut after their first chunk (the worker computed their prompt,
    then the client went away: 499, not served). It used to be requests the worker refused (``top_p:
    0``); the worker now serves every request that passes the gateway's checks (review r6 #6)."""
    system = system_with("the victim's private instructions")
    victim, attacker_1, attacker_2 = [await key(gateway, n) for n in ("victim", "a1", "a2")]
    await served(gateway, victim, system, "a real question")
    for attacker in (attacker_1, attacker_2):
        for i in range(3):
            cut = await ask(
                gateway, attacker, system, f"pad {i}", stream=True, max_tokens=2000, ignore_eos=True
            )
            assert cut.status == 200 and await cut.content.readany()  # the stream started
            cut.close()  # and the client went away
    await settle()
    probe = await served(gateway, attacker_1, system, "probe")
    await settle()
    assert promoted_tokens(probe) == 0
    assert await hot_prefixes(gateway, include_revoked="true") == []


async def test_a_tenant_is_never_told_of_a_promotion_it_did_not_contribute_to(gateway):
    system = system_with("a prompt three tenants share")
    a, b, c, late = [await key(gateway, n) for n in ("a", "b", "c", "late")]
    for api_key, user in ((a, "qa"), (b, "qb")):
        assert promoted_tokens(await served(gateway, api_key, system, user)) == 0
    trigger = await served(gateway, c, system, "qc")
    assert promoted_tokens(trigger) == 0  # the request that completes the count learns nothing
    (row,) = await wait_for_hot_prefixes(gateway, 1)

    newcomer = await served(gateway, late, system, "first request")
    assert promoted_tokens(newcomer) == 0  # served from the shared copy, but never told so
    contributor = await served(gateway, a, system, "again")
    assert promoted_tokens(contributor) == row["num_tokens"]  # it helped promote it before


async def test_one_party_padding_hits_cannot_stand_in_for_other_tenants(
    aiohttp_client, sqlite_url, tmp_path, worker_url
):
    """Each tenant's hits count only up to min_hits / min_tenants, so k−1 tenants of an attacker need the
    victim to have sent the prompt often, not once."""
    config = make_config(
        sqlite_url, tmp_path, worker_urls=(worker_url,), promotion_min_hits=9, promotion_min_tenants=3
    )
    gateway = await aiohttp_client(create_app(config))
    system = system_with("sent once by the victim")
    victim, a1, a2 = [await key(gateway, n) for n in ("victim", "a1", "a2")]
    await served(gateway, victim, system, "once")
    for i in range(6):
        for attacker in (a1, a2):
            await served(gateway, attacker, system, f"pad {i}")
    await settle()
    assert await hot_prefixes(gateway, include_revoked="true") == []


async def test_shared_tenants_do_not_read_promoted_prefixes_without_opting_in(gateway):
    system = system_with("promoted among namespace tenants")
    for i, name in enumerate(("p1", "p2", "p3")):
        await served(gateway, await key(gateway, name), system, f"q{i}")
    await wait_for_hot_prefixes(gateway, 1)
    for i, name in enumerate(("p1b", "p2b")):  # warm the promoted copy
        await served(gateway, await key(gateway, name), system, f"w{i}")
    outsider = (await create_tenant(gateway, name="shared-outsider", isolation="shared"))["api_key"]
    result = await served(gateway, outsider, system, "w0")
    assert cached(result) == 0 and promoted_tokens(result) == 0


async def test_promotions_store_hashes_not_text(gateway):
    system = system_with("text that must not be stored")
    for i, name in enumerate(("s1", "s2", "s3")):
        await served(gateway, await key(gateway, name), system, f"q{i}")
    (row,) = await wait_for_hot_prefixes(gateway, 1)
    async with gateway.app[ENGINE].connect() as connection:
        stored = (await connection.execute(text("SELECT text FROM hot_prefixes"))).scalar_one()
    assert stored is None
    assert len(row["prefix_hash"]) == 64


def test_k_is_at_least_three():
    assert PromotionPolicy(min_hits_per_hour=1, min_tenants=2).min_tenants == 3
