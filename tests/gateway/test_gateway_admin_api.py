import asyncio
import json

import pytest

from gateway.cli import main as cli_main
from gateway.state import USAGE_WRITER
from tenancy.usage_types import Prices, UsageEvent
from tests.gateway.conftest import ADMIN, ADMIN_TOKEN, create_tenant


def tenant_headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


async def test_admin_requires_token(client):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN_TOKEN}):
        response = await client.get("/admin/v1/tenants", headers=headers)
        assert response.status == 401
        assert (await response.json())["error"]["type"] == "authentication_error"


async def test_admin_disabled_without_token(aiohttp_client, config):
    import dataclasses

    from gateway.app import create_app

    client = await aiohttp_client(create_app(dataclasses.replace(config, admin_token=None)))
    response = await client.get("/admin/v1/tenants", headers=ADMIN)
    assert response.status == 403


async def test_tenant_lifecycle(gateway):
    client = gateway  # with a worker: every delete purges the tenant's own namespaces first
    created = await create_tenant(
        client, isolation="dedicated", reserved_blocks=32, price_output_per_mtok=3.5
    )
    tenant_id, api_key = created["id"], created["api_key"]
    assert created["isolation"] == "dedicated" and created["reserved_blocks"] == 32
    assert created["namespace_id"].startswith("t-") and created["epoch"] == 0

    models = await client.get("/v1/models", headers=tenant_headers(api_key))
    assert models.status == 200 and (await models.json())["object"] == "list"

    listed = await (await client.get("/admin/v1/tenants", headers=ADMIN)).json()
    assert [t["id"] for t in listed["data"]] == [tenant_id]
    assert "api_key" not in listed["data"][0]
    got = await (await client.get(f"/admin/v1/tenants/{tenant_id}", headers=ADMIN)).json()
    assert got["price_output_per_mtok"] == 3.5 and got["created_at"]

    patched = await client.patch(
        f"/admin/v1/tenants/{tenant_id}", json={"isolation": "shared"}, headers=ADMIN
    )
    assert (await patched.json())["isolation"] == "shared"
    bad = await client.patch(f"/admin/v1/tenants/{tenant_id}", json={"isolation": "open"}, headers=ADMIN)
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "isolation"

    # A shared tenant's KV is the common pool's: no epoch of its own to bump; only what it cached in its
    # own namespace before the move is its own to purge (the delete does it).
    invalidated = await client.post(f"/admin/v1/tenants/{tenant_id}/invalidate", headers=ADMIN)
    assert invalidated.status == 409 and (await invalidated.json())["error"]["code"] == "shared_cache"
    refused = await client.delete(f"/admin/v1/tenants/{tenant_id}", headers=ADMIN)
    assert refused.status == 409

    deleted = await client.delete(f"/admin/v1/tenants/{tenant_id}?shared_cache=keep", headers=ADMIN)
    body = await deleted.json()
    assert body["deleted"] is True and body["purge"]["namespace_id"] == created["namespace_id"]
    assert (await client.get("/v1/models", headers=tenant_headers(api_key))).status == 401
    missing = await client.get(f"/admin/v1/tenants/{tenant_id}", headers=ADMIN)
    assert missing.status == 404 and (await missing.json())["error"]["type"] == "not_found_error"

    audit = await (await client.get("/admin/v1/audit", headers=ADMIN)).json()
    assert [row["action"] for row in audit["data"]] == [
        "tenant.delete",
        "tenant.purge",
        "tenant.invalidate",
        "tenant.delete_fence",  # keys revoked: other replicas refuse it before the purge (review r22)
        "tenant.update",
        "tenant.create",
    ]
    assert api_key not in json.dumps(audit)


async def test_create_errors(client):
    await create_tenant(client)
    duplicate = await client.post("/admin/v1/tenants", json={"name": "acme"}, headers=ADMIN)
    assert duplicate.status == 409
    no_name = await client.post("/admin/v1/tenants", json={"isolation": "shared"}, headers=ADMIN)
    assert no_name.status == 400 and (await no_name.json())["error"]["param"] == "name"
    not_json = await client.post("/admin/v1/tenants", data=b"{nope", headers=ADMIN)
    assert not_json.status == 400


async def test_keys_rotate_and_revoke(client):
    created = await create_tenant(client)
    tenant_id, first = created["id"], created["api_key"]
    added = await (await client.post(f"/admin/v1/tenants/{tenant_id}/keys", headers=ADMIN)).json()
    for key in (first, added["api_key"]):
        assert (await client.get("/v1/models", headers=tenant_headers(key))).status == 200

    rotated = await client.post(f"/admin/v1/tenants/{tenant_id}/keys/rotate", headers=ADMIN)
    assert rotated.status == 201
    new_key = (await rotated.json())["api_key"]
    for key in (first, added["api_key"]):
        response = await client.get("/v1/models", headers=tenant_headers(key))
        assert response.status == 401 and (await response.json())["error"]["code"] == "invalid_api_key"
    assert (await client.get("/v1/models", headers=tenant_headers(new_key))).status == 200

    keys = (await (await client.get(f"/admin/v1/tenants/{tenant_id}/keys", headers=ADMIN)).json())["data"]
    live = [k for k in keys if not k["revoked"]]
    assert len(keys) == 3 and len(live) == 1 and "api_key" not in live[0]
    revoked = await client.post(f"/admin/v1/tenants/{tenant_id}/keys/{live[0]['id']}/revoke", headers=ADMIN)
    assert (await revoked.json())["revoked"] is True
    assert (await client.get("/v1/models", headers=tenant_headers(new_key))).status == 401


async def test_usage_report_json_and_csv(client):
    created = await create_tenant(client, price_input_per_mtok=2.0, price_cached_input_per_mtok=0.5)
    writer = client.app[USAGE_WRITER]
    for i in range(3):
        writer.submit(
            UsageEvent(
                request_id=f"r{i}",
                tenant_id=created["id"],
                model="m",
                endpoint="completions",
                status=200,
                prompt_tokens=1000,
                cached_tokens=500,
                completion_tokens=10,
                saved_prefill_ms=100.0,
                # Priced by the gateway when the request ran (tenancy.usage_types: frozen per record).
                prices=Prices(input_per_mtok=2.0, cached_input_per_mtok=0.5, output_per_mtok=2.0),
            )
        )
    await writer.flush()
    report = await client.get(
        "/admin/v1/reports/usage", params={"tenant_id": created["id"], "granularity": "hour"}, headers=ADMIN
    )
    body = await report.json()
    assert body["totals"]["requests"] == 3 and body["totals"]["hit_rate"] == 0.5
    row = body["data"][0]
    assert row["saved_prefill_s"] == pytest.approx(0.3) and row["cost_cached_input"] == pytest.approx(
        1500 * 0.5 / 1e6
    )
    csv_response = await client.get("/admin/v1/reports/usage", params={"format": "csv"}, headers=ADMIN)
    assert csv_response.content_type == "text/csv"
    assert len((await csv_response.text()).splitlines()) == 2
    bad = await client.get("/admin/v1/reports/usage", params={"granularity": "week"}, headers=ADMIN)
    assert bad.status == 400
    bad_time = await client.get("/admin/v1/reports/usage", params={"start": "yesterday"}, headers=ADMIN)
    assert bad_time.status == 400


async def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = await asyncio.to_thread(cli_main, list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


async def test_cli_talks_to_admin_api(client, capsys, monkeypatch):
    monkeypatch.setenv("PREFIXGATE_URL", str(client.make_url("")))
    monkeypatch.setenv("PREFIXGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    code, out, _ = await run_cli(
        capsys,
        "tenant",
        "create",
        "cli-co",
        "--isolation",
        "namespace",
        "--reserved-blocks",
        "0",
        "--no-share-hot-prefixes",
    )
    assert code == 0
    created = json.loads(out)
    assert created["isolation"] == "namespace" and created["api_key"].startswith("sk-pg-")

    code, out, _ = await run_cli(capsys, "tenant", "update", "cli-co", "--price-output-per-mtok", "4")
    assert json.loads(out)["price_output_per_mtok"] == 4.0
    code, out, _ = await run_cli(capsys, "tenant", "list")
    assert [t["name"] for t in json.loads(out)["data"]] == ["cli-co"]
    code, out, _ = await run_cli(capsys, "tenant", "invalidate", created["id"])
    assert json.loads(out)["epoch"] == 1
    code, out, _ = await run_cli(capsys, "tenant", "rotate-key", "cli-co")
    rotated = json.loads(out)
    code, out, _ = await run_cli(capsys, "tenant", "keys", "cli-co")
    assert sum(not k["revoked"] for k in json.loads(out)["data"]) == 1
    code, out, _ = await run_cli(capsys, "tenant", "revoke-key", "cli-co", rotated["id"])
    assert json.loads(out)["revoked"] is True
    code, out, _ = await run_cli(capsys, "report", "usage", "--tenant", "cli-co", "--format", "csv")
    assert code == 0 and out.startswith("tenant_id,")
    code, out, _ = await run_cli(capsys, "tenant", "audit", "--tenant", "cli-co")
    assert len(json.loads(out)["data"]) == 5
    code, out, _ = await run_cli(capsys, "diagnose")
    assert json.loads(out)["tenants"] == 1
    code, _, err = await run_cli(capsys, "tenant", "get", "nobody")
    assert code == 1 and "no tenant named" in err
    code, _, err = await run_cli(capsys, "tenant", "delete", "cli-co")  # purges first: no worker answers
    assert code == 1 and "502" in err

    monkeypatch.setenv("PREFIXGATE_ADMIN_TOKEN", "wrong")
    code, _, err = await run_cli(capsys, "tenant", "list")
    assert code == 1 and "401" in err


@pytest.mark.parametrize("path", ["/admin/v1/", "/admin/v1/tenants/", "/admin/v1/no/such/route"])
async def test_an_unknown_admin_path_is_no_route_not_an_unknown_id(client, path):
    """r22: the admin catch-all's ``{tail}`` went through the id check: "no tail with that id"."""
    answer = await client.get(path, headers=ADMIN)
    assert answer.status == 404
    assert (await answer.json())["error"]["message"] == f"no route for GET {path}"
