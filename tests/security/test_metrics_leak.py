"""/metrics no longer tells anyone who asks how many tokens each tenant sends (issue 11)."""

import dataclasses

from gateway.app import create_app
from policies.isolation import tenant_namespace_id
from tests.gateway.conftest import ADMIN, create_tenant
from tests.gateway.test_gateway_e2e import auth, chat, chat_body, unique_system_prompt


async def test_metrics_need_a_token(aiohttp_client, config):
    client = await aiohttp_client(create_app(dataclasses.replace(config, metrics_token="scrape-me")))
    for headers in ({}, {"Authorization": "Bearer wrong"}, auth((await create_tenant(client))["api_key"])):
        response = await client.get("/metrics", headers=headers)
        assert response.status == 401, headers
        assert (await response.json())["error"]["type"] == "authentication_error"
    assert (await client.get("/metrics", headers={"Authorization": "Bearer scrape-me"})).status == 200
    assert (await client.get("/metrics", headers=ADMIN)).status == 200  # the admin token works too


async def test_metrics_without_their_own_token_need_the_admin_token(client):
    assert (await client.get("/metrics")).status == 401
    assert (await client.get("/metrics", headers=ADMIN)).status == 200


async def test_tenant_labels_can_be_hashed(aiohttp_client, sqlite_url, tmp_path, worker_url):
    from tests.gateway.conftest import make_config

    config = make_config(sqlite_url, tmp_path, worker_urls=(worker_url,), metrics_tenant_labels="hash")
    gateway = await aiohttp_client(create_app(config))
    tenant = await create_tenant(gateway)
    await chat(gateway, tenant["api_key"], chat_body(unique_system_prompt()))
    text = await (await gateway.get("/metrics", headers=ADMIN)).text()
    assert tenant["id"] not in text
    label = tenant_namespace_id(config.salt_bytes, tenant["id"])
    assert label == tenant["namespace_id"]  # admins can map a label back; nobody else can
    assert f'prefixgate_prompt_tokens_total{{tenant="{label}"}}' in text
