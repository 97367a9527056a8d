"""Gateway fixtures: the real app (aiohttp_client) on a real database."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.up import free_port
from tests.tenancy.db_support import db_url, pg_database, pg_url, sqlite_template, sqlite_url  # noqa: F401

ADMIN_TOKEN = "admin-test-token"


def make_config(database_url: str, data_dir: Path, **changes) -> GatewayConfig:
    config = GatewayConfig(
        data_dir=data_dir,
        database_url=database_url,
        worker_urls=(f"http://127.0.0.1:{free_port()}",),  # nothing listens there unless a test says so
        admin_token=ADMIN_TOKEN,
        namespace_salt="test-salt",
        policy_refresh_s=0.1,
        usage_flush_s=0.05,
        worker_health_interval_s=0.5,
    )
    return dataclasses.replace(config, **changes)


@pytest.fixture
def config(sqlite_url: str, tmp_path: Path) -> GatewayConfig:  # noqa: F811
    return make_config(sqlite_url, tmp_path)


@pytest.fixture
async def client(aiohttp_client, config):
    return await aiohttp_client(create_app(config))


ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
def admin_headers() -> dict[str, str]:
    return dict(ADMIN)


async def create_tenant(client, **fields) -> dict:
    response = await client.post("/admin/v1/tenants", json={"name": "acme", **fields}, headers=ADMIN)
    assert response.status == 201, await response.text()
    return await response.json()
