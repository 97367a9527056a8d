"""Admin calls racing each other on one tenant, on SQLite and on PostgreSQL (review r15 #1, #2).

Every change locks the tenant's row first: concurrent rotations leave one live key, a change that loses
the race to a DELETE is a 404 (never a 500 from a stale UPDATE, a deadlock or a foreign-key error), and
an action that runs twice at once is done (and audited) once.
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.app import create_app
from tests.gateway.conftest import ADMIN, make_config


@pytest.fixture
async def db_client(aiohttp_client, db_url, tmp_path, worker_url):
    return await aiohttp_client(create_app(make_config(db_url, tmp_path, worker_urls=(worker_url,))))


async def _shared_tenant(client, name: str) -> str:
    """A ``shared`` tenant: deleting it with ?shared_cache=keep purges only its own (empty) namespaces."""
    response = await client.post(
        "/admin/v1/tenants", json={"name": name, "isolation": "shared"}, headers=ADMIN
    )
    assert response.status == 201, await response.text()
    return (await response.json())["id"]


async def _audit_actions(client, tenant_id: str) -> list[str]:
    response = await client.get(f"/admin/v1/audit?tenant_id={tenant_id}", headers=ADMIN)
    return [row["action"] for row in (await response.json())["data"]]


async def _after(delay_s: float, call, *args, **kwargs):
    await asyncio.sleep(delay_s)
    return await call(*args, headers=ADMIN, **kwargs)


async def test_concurrent_rotations_leave_one_live_key(db_client):
    tenant_id = await _shared_tenant(db_client, "rotor")
    path = f"/admin/v1/tenants/{tenant_id}/keys"
    responses = await asyncio.gather(*(db_client.post(f"{path}/rotate", headers=ADMIN) for _ in range(6)))
    assert [r.status for r in responses] == [201] * 6
    keys = (await (await db_client.get(path, headers=ADMIN)).json())["data"]
    live = [key["id"] for key in keys if not key["revoked"]]
    assert len(live) == 1, f"{len(live)} keys live after 6 concurrent rotations"
    assert live[0] in [(await r.json())["id"] for r in responses]


async def test_changes_racing_a_delete_are_a_404_never_a_500(db_client):
    statuses = []
    for round_ in range(6):
        tenant_id = await _shared_tenant(db_client, f"doomed{round_}")
        path = f"/admin/v1/tenants/{tenant_id}"
        key_id = (await (await db_client.get(f"{path}/keys", headers=ADMIN)).json())["data"][0]["id"]
        calls = [db_client.delete(f"{path}?shared_cache=keep", headers=ADMIN)]
        for i in range(4):
            delay_s = 0.001 * (i + round_ % 3)
            calls += [
                _after(delay_s, db_client.patch, path, json={"rate_limit_rpm": 7}),
                _after(delay_s, db_client.post, f"{path}/keys/rotate"),
                _after(delay_s, db_client.post, f"{path}/keys"),
                _after(delay_s, db_client.post, f"{path}/keys/{key_id}/revoke"),
            ]
        for response in await asyncio.gather(*calls):
            statuses.append((response.method, response.status, (await response.text())[:200]))
    assert not [s for s in statuses if s[1] not in (200, 201, 404)], statuses
    assert ("DELETE", 200) in {(method, status) for method, status, _ in statuses}


async def test_two_concurrent_deletes_are_one_200_and_one_404(db_client):
    tenant_id = await _shared_tenant(db_client, "twice")
    path = f"/admin/v1/tenants/{tenant_id}?shared_cache=keep"
    responses = await asyncio.gather(*(db_client.delete(path, headers=ADMIN) for _ in range(2)))
    assert sorted(r.status for r in responses) == [200, 404]
    assert (await _audit_actions(db_client, tenant_id)).count("tenant.delete") == 1


async def test_a_revocation_racing_itself_is_audited_once(db_client):
    tenant_id = await _shared_tenant(db_client, "revoker")
    path = f"/admin/v1/tenants/{tenant_id}/keys"
    key_id = (await (await db_client.get(path, headers=ADMIN)).json())["data"][0]["id"]
    responses = await asyncio.gather(
        *(db_client.post(f"{path}/{key_id}/revoke", headers=ADMIN) for _ in range(4))
    )
    assert [r.status for r in responses] == [200] * 4
    assert (await _audit_actions(db_client, tenant_id)).count("key.revoke") == 1
