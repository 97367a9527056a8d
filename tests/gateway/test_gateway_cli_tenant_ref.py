"""A tenant named like another tenant's id cannot turn ``prefixgate tenant delete|purge <id>`` on the
wrong tenant (review r15 #7): a reference that is one tenant's id and another's name is refused, and
``--id`` says which is meant."""

from __future__ import annotations

import json

import pytest

from tests.gateway.conftest import ADMIN, ADMIN_TOKEN, create_tenant
from tests.gateway.test_gateway_admin_api import run_cli


async def _names(gateway) -> set[str]:
    tenants = await (await gateway.get("/admin/v1/tenants", headers=ADMIN)).json()
    return {tenant["name"] for tenant in tenants["data"]}


@pytest.mark.parametrize("command", ["delete", "purge"])
async def test_a_name_that_is_another_tenants_id_is_refused(gateway, capsys, monkeypatch, command):
    monkeypatch.setenv("PREFIXGATE_URL", str(gateway.make_url("")))
    monkeypatch.setenv("PREFIXGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    victim = await create_tenant(gateway, name="victim")
    await create_tenant(gateway, name=victim["id"])  # named like the victim's id

    code, out, err = await run_cli(capsys, "tenant", command, victim["id"])
    assert code == 1 and "--id" in err and out == "", err
    assert await _names(gateway) == {"victim", victim["id"]}  # neither was touched
    audit = await (await gateway.get("/admin/v1/audit", headers=ADMIN)).json()
    assert [row["action"] for row in audit["data"]] == ["tenant.create", "tenant.create"]

    code, out, err = await run_cli(capsys, "tenant", command, "--id", victim["id"])
    assert code == 0, err
    assert json.loads(out)["id"] == victim["id"]
    if command == "delete":
        assert await _names(gateway) == {victim["id"]}
        code, out, err = await run_cli(capsys, "tenant", "delete", victim["id"])  # now only a name
        assert code == 0 and json.loads(out)["deleted"] is True, err
        assert await _names(gateway) == set()


async def test_ids_and_names_still_resolve_alone(gateway, capsys, monkeypatch):
    monkeypatch.setenv("PREFIXGATE_URL", str(gateway.make_url("")))
    monkeypatch.setenv("PREFIXGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    acme = await create_tenant(gateway, name="acme")
    for ref in (acme["id"], "acme"):
        code, out, err = await run_cli(capsys, "tenant", "get", ref)
        assert code == 0 and json.loads(out)["id"] == acme["id"], err
    code, _, err = await run_cli(capsys, "tenant", "get", "tn_0000000000000000")
    assert code == 1 and "no tenant named" in err
