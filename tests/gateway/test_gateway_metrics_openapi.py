from gateway.openapi import _POLICY_PROPS
from tenancy.policy import POLICY_FIELDS
from tests.gateway.conftest import ADMIN, create_tenant


async def test_metrics_use_a_per_app_registry(client):
    key = (await create_tenant(client))["api_key"]
    await client.post(
        "/v1/completions", json={"model": "m", "prompt": "x"}, headers={"Authorization": f"Bearer {key}"}
    )
    await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
    text = await (await client.get("/metrics", headers=ADMIN)).text()
    assert 'prefixgate_requests_total{endpoint="completions",status="503"' in text
    assert "prefixgate_usage_spool_depth 0.0" in text
    assert "prefixgate_auth_failures_total 1.0" in text
    assert "prefixgate_request_duration_seconds_bucket" in text


async def test_two_apps_do_not_share_metrics(aiohttp_client, config):
    from gateway.app import create_app

    first = await aiohttp_client(create_app(config))
    second = await aiohttp_client(create_app(config))
    await first.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert "prefixgate_auth_failures_total 1.0" in await (await first.get("/metrics", headers=ADMIN)).text()
    assert "prefixgate_auth_failures_total 0.0" in await (await second.get("/metrics", headers=ADMIN)).text()


async def test_openapi_describes_tenant_and_admin_apis(client):
    spec = await (await client.get("/openapi.json")).json()
    assert spec["openapi"].startswith("3.")
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/admin/v1/tenants",
        "/admin/v1/tenants/{tenant_id}/invalidate",
        "/admin/v1/reports/usage",
    ):
        assert path in spec["paths"]
    assert set(_POLICY_PROPS) == set(POLICY_FIELDS)
