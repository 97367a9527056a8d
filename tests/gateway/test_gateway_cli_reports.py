"""``prefixgate report requests --format csv`` exports every page, formula-safe (review r15 #6).

A CSV file has no room for the cursor of its next page: the export stopped after ``--limit`` records
(1,000 by default) and said nothing.
"""

from __future__ import annotations

import csv
import io
import json

from tests.gateway.conftest import ADMIN_TOKEN, create_tenant
from tests.gateway.test_gateway_admin_api import run_cli
from tests.gateway.test_gateway_billing import wait_records
from tests.gateway.test_gateway_e2e import auth, chat_body, unique_system_prompt

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


async def test_a_csv_request_export_follows_every_page_and_is_formula_safe(gateway, capsys, monkeypatch):
    monkeypatch.setenv("PREFIXGATE_URL", str(gateway.make_url("")))
    monkeypatch.setenv("PREFIXGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    key = (await create_tenant(gateway, name="=cmd|' /C calc'!A0"))["api_key"]
    # Tenant-controlled strings: the tenant's name, the end user, the client's x-request-id.
    for user, request_id in (("@SUM(A1)", "-2.3"), ("+1", "plain"), ("-1", "-calc")):
        body = {**chat_body(unique_system_prompt()), "user": user}
        headers = {**auth(key), "x-request-id": request_id}
        response = await gateway.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status == 200, await response.text()
    await wait_records(gateway, 3)

    code, out, _ = await run_cli(capsys, "report", "requests", "--limit", "1")
    page = json.loads(out)  # JSON: one page, and where the next one starts
    assert code == 0 and len(page["data"]) == 1 and page["has_more"] and page["next_cursor"]

    code, out, err = await run_cli(capsys, "report", "requests", "--limit", "1", "--format", "csv")
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 3, out  # every page, one header
    assert {row["end_user"] for row in rows} == {"'@SUM(A1)", "'+1", "'-1"}
    assert {row["tenant_name"] for row in rows} == {"'=cmd|' /C calc'!A0"}
    assert any(row["request_id"].startswith("'-2.3") for row in rows)
    assert not [cell for row in rows for cell in row.values() if cell.startswith(FORMULA_START)]

    code, out, _ = await run_cli(
        capsys, "report", "requests", "--format", "csv", "--cursor", page["next_cursor"]
    )
    assert code == 0 and len(list(csv.DictReader(io.StringIO(out)))) == 2  # the pages after a cursor
