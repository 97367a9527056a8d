"""Review r22: deleting a tenant on one replica while another still has it in its policy snapshot. The
delete fences the tenant first (keys revoked), waits for the other replicas' policy polls, then purges:
what the other replica cached for the tenant until its poll is erased, and it refuses the tenant after."""

import asyncio
import time

from gateway.app import create_app
from gateway.state import POLICY_CACHE, WORKER_POOL
from tests.gateway.conftest import ADMIN, create_tenant, make_config
from tests.gateway.test_gateway_e2e import auth, chat_body, unique_system_prompt


async def fenced(replica, api_key: str, timeout_s: float = 5.0) -> None:
    """Until the deleting replica refuses the key (its fence is committed)."""
    started = time.monotonic()
    while replica.app[POLICY_CACHE].authenticate(api_key) is not None:
        assert time.monotonic() - started < timeout_s, "the delete never fenced the tenant"
        await asyncio.sleep(0.01)


async def test_a_deleted_tenant_leaves_no_kv_on_another_replica(aiohttp_client, pg_url, tmp_path, worker_url):
    # Replicas share one config: each polls every second, so a delete waits 2.5 s before it purges.
    config = dict(worker_urls=(worker_url,), policy_refresh_s=1.0)
    a = await aiohttp_client(create_app(make_config(pg_url, tmp_path / "a", **config)))
    b = await aiohttp_client(create_app(make_config(pg_url, tmp_path / "b", **config)))
    tenant = await create_tenant(a)
    await b.app[POLICY_CACHE].reload()  # B has the tenant, as after any poll
    deleting = asyncio.create_task(a.delete(f"/admin/v1/tenants/{tenant['id']}", headers=ADMIN))
    await fenced(a, tenant["api_key"])
    # B has not polled since: it may still serve the tenant, and cache its KV (until its next poll).
    during = await b.post(
        "/v1/chat/completions", json=chat_body(unique_system_prompt()), headers=auth(tenant["api_key"])
    )
    deleted = await deleting
    body = await deleted.json()
    assert deleted.status == 200 and body["purge"]["complete"], body
    after = await b.post(
        "/v1/chat/completions", json=chat_body(unique_system_prompt()), headers=auth(tenant["api_key"])
    )
    left = 0
    for namespace_id in body["purge"]["namespace_ids"]:  # what the workers still hold under its ids
        erased = await b.app[WORKER_POOL].client(worker_url).purge(namespace_id)
        left += sum(erased.values())
    print("replica B during the delete:", during.status, "after:", after.status, "blocks left:", left)
    assert after.status == 401, "a deleted tenant is still served by another replica"
    assert left == 0, "KV cached by another replica outlived the delete's purge"
