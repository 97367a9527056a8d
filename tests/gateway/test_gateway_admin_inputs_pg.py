"""Admin API inputs on PostgreSQL (which refuses NUL in text and checks int64 bounds): a malformed id
is a 404, a NUL in a value or an out-of-range cursor a 400, never a 500 (hostile-input review, finding 6;
forged report cursors: review r6 #4)."""

import base64
import json

import pytest

from gateway.app import create_app
from tests.gateway.conftest import ADMIN, make_config
from tests.security.test_input_hardening import assert_openai_error


@pytest.fixture
async def pg_client(aiohttp_client, pg_url, tmp_path):
    return await aiohttp_client(create_app(make_config(pg_url, tmp_path)))


def _report_cursor(values: list) -> str:
    return base64.urlsafe_b64encode(json.dumps(values).encode()).decode()


CASES = [
    ("post", "/admin/v1/tenants", {"name": "a\u0000b"}, 400),
    ("post", "/admin/v1/tenants", {"name": "ok", "canonicalization_patterns": {"p\u0000": "x"}}, 400),
    ("post", "/admin/v1/tenants", {"name": "ok", "canonicalization_patterns": {"p": "x\u0000"}}, 400),
    ("get", "/admin/v1/tenants/tn_%00", None, 404),
    ("get", "/admin/v1/tenants/" + "x" * 5000, None, 404),
    ("post", "/admin/v1/tenants/tn_%00/keys", None, 404),
    ("patch", "/admin/v1/tenants/tn_%00", {"rate_limit_rpm": 1}, 404),
    ("delete", "/admin/v1/tenants/tn_x/keys/key_%00", None, 404),
    ("get", "/admin/v1/hot-prefixes/hp_%00", None, 404),
    ("get", "/admin/v1/audit?tenant_id=%00", None, 400),
    ("get", "/admin/v1/audit?limit=-1", None, 400),  # was clamped to 1 (a 200), unlike the reports' limit
    ("get", "/admin/v1/audit?limit=0", None, 400),
    ("get", "/admin/v1/audit?limit=10001", None, 400),
    ("get", "/admin/v1/audit?limit=%2B5", None, 400),
    ("get", "/admin/v1/reports/usage?limit=1_000", None, 400),
    ("get", "/admin/v1/reports/requests?limit=%EF%BC%95", None, 400),  # a full-width 5
    ("get", "/admin/v1/reports/usage?tenant_id=%00", None, 400),
    ("get", "/admin/v1/reports/requests?tenant_id=%00", None, 400),
    ("get", "/admin/v1/reports/requests?cursor=99999999999999999999999", None, 400),
    ("get", "/admin/v1/reports/requests?cursor=9223372036854775808", None, 400),
    ("get", "/admin/v1/reports/requests?cursor=%2B5", None, 400),
    ("get", "/admin/v1/reports/requests?cursor=1_000", None, 400),
    ("get", "/admin/v1/reports/requests?cursor=%EF%BC%95", None, 400),  # a full-width 5
    ("get", "/admin/v1/reports/usage?cursor=" + _report_cursor([1, "\u0000", "m", 0, ""]), None, 400),
    ("get", "/admin/v1/reports/usage?cursor=" + _report_cursor([1, "tn_x", "\ud800", 0, ""]), None, 400),
    ("get", "/admin/v1/reports/usage?cursor=" + _report_cursor([1, "tn_x", "m", 1, "\ud800k"]), None, 400),
    ("get", "/admin/v1/reports/usage?start=0001-01-01&end=9999-12-31", None, None),
    ("get", "/admin/v1/reports/usage?start=9999-12-31T23:59:59-23:59", None, None),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), CASES)
async def test_bad_admin_input_is_a_4xx(pg_client, method, path, body, status):
    kwargs = {"headers": ADMIN}
    if body is not None:
        kwargs["json"] = body
    response = await getattr(pg_client, method)(path, **kwargs)
    text = await response.text()
    assert response.status < 500, text[:300]
    if status is not None:
        assert response.status == status, text[:300]
        assert_openai_error(await response.json())


async def test_a_well_formed_tenant_id_and_the_last_cursor_still_work(pg_client):
    created = await pg_client.post("/admin/v1/tenants", json={"name": "fine"}, headers=ADMIN)
    tenant_id = (await created.json())["id"]
    response = await pg_client.get(f"/admin/v1/tenants/{tenant_id}", headers=ADMIN)
    assert response.status == 200
    response = await pg_client.get(
        f"/admin/v1/reports/requests?tenant_id={tenant_id}&cursor=9223372036854775807", headers=ADMIN
    )
    assert response.status == 200, await response.text()
    assert (await response.json())["data"] == []
