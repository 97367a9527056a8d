"""One namespace secret per deployment: two replicas on one PostgreSQL derive the same namespaces."""

import asyncio
import random

from gateway.app import create_app
from gateway.namespace_secret import resolve_namespace_secret
from tenancy.db import create_engine, create_sessionmaker
from tenancy.namespace_secret import NamespaceSecretRepository
from tests.gateway.conftest import ADMIN, make_config
from tests.gateway.test_gateway_e2e import MODEL


async def completion(client, key: str, prompt: list[int]) -> dict:
    response = await client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert response.status == 200, await response.text()
    return (await response.json())["usage"]


async def test_two_replicas_share_the_databases_secret(aiohttp_client, pg_url, tmp_path, worker_url):
    configs = [
        make_config(pg_url, tmp_path / name, namespace_salt=None, worker_urls=(worker_url,)) for name in "ab"
    ]
    # Both start at once: whichever creates the secret first, the other one reads it.
    a, b = await asyncio.gather(*(aiohttp_client(create_app(config)) for config in configs))
    created = await (await a.post("/admin/v1/tenants", json={"name": "acme"}, headers=ADMIN)).json()
    on_a = await (await a.get(f"/admin/v1/tenants/{created['id']}", headers=ADMIN)).json()
    await asyncio.sleep(0.3)  # the policy refresh brings the tenant to b
    on_b = await (await b.get(f"/admin/v1/tenants/{created['id']}", headers=ADMIN)).json()
    assert on_a["namespace_id"] == on_b["namespace_id"]
    assert not (tmp_path / "a" / "namespace_salt").exists()  # no per-data-dir salt any more

    # Same namespace key too: what a cached through one replica is a hit through the other.
    prompt = [random.randrange(1, 200) for _ in range(64)]
    assert (await completion(a, created["api_key"], prompt))["prompt_tokens_details"]["cached_tokens"] == 0
    assert (await completion(b, created["api_key"], prompt))["prompt_tokens_details"]["cached_tokens"] >= 48

    # Rotation: a new epoch in the database; each replica says which one it still uses until restarted.
    status = await (await a.get("/admin/v1/namespace-secret", headers=ADMIN)).json()
    assert status["source"] == "database" and status["epoch"] == status["epoch_in_use"]
    assert "secret" not in status
    rotated = await (await b.post("/admin/v1/namespace-secret/rotate", headers=ADMIN)).json()
    assert rotated["epoch"] == status["epoch"] + 1 and rotated["restart_required"]
    after = await (await a.get("/admin/v1/namespace-secret", headers=ADMIN)).json()
    assert (after["epoch"], after["epoch_in_use"]) == (rotated["epoch"], status["epoch"])
    c = await aiohttp_client(create_app(make_config(pg_url, tmp_path / "c", namespace_salt=None)))
    on_c = await (await c.get(f"/admin/v1/tenants/{created['id']}", headers=ADMIN)).json()
    assert on_c["namespace_id"] != on_a["namespace_id"]  # a replica started after it: new namespaces


async def test_secret_is_created_once_seeded_from_a_legacy_file_and_rotated(pg_url, tmp_path):
    engine = create_engine(pg_url)
    repository = NamespaceSecretRepository(create_sessionmaker(engine))
    first = await repository.get_or_create()  # the shared PG database may hold one from another test
    legacy_dir = tmp_path / "legacy"
    legacy_dir.mkdir()
    (legacy_dir / "namespace_salt").write_text("old-salt\n")
    resolved, epoch = await resolve_namespace_secret(
        make_config(pg_url, legacy_dir, namespace_salt=None), repository
    )
    assert (resolved.namespace_salt, epoch) == (first.secret, first.epoch)  # the deployment's beats a file
    given, _ = await resolve_namespace_secret(
        make_config(pg_url, tmp_path, namespace_salt="explicit"), repository
    )
    assert given.namespace_salt == "explicit"
    rotated = await repository.rotate()
    assert rotated.epoch == first.epoch + 1 and rotated.secret != first.secret
    assert await repository.current() == rotated and "secret=<hidden>" in repr(rotated)
    await engine.dispose()


async def test_a_legacy_salt_file_seeds_a_fresh_database(sqlite_url, tmp_path):
    (tmp_path / "namespace_salt").write_text("old-salt\n")
    engine = create_engine(sqlite_url)
    repository = NamespaceSecretRepository(create_sessionmaker(engine))
    resolved, _ = await resolve_namespace_secret(
        make_config(sqlite_url, tmp_path, namespace_salt=None), repository
    )
    assert resolved.namespace_salt == "old-salt" and (await repository.current()).epoch == 0
    await engine.dispose()


async def test_a_configured_secret_is_not_rotated_through_the_api(client):
    status = await (await client.get("/admin/v1/namespace-secret", headers=ADMIN)).json()
    assert status["source"] == "config" and status["epoch_in_use"] is None
    response = await client.post("/admin/v1/namespace-secret/rotate", headers=ADMIN)
    assert response.status == 409 and (await response.json())["error"]["code"] == "secret_configured"
