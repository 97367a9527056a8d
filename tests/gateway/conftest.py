"""Gateway fixtures: the real app (aiohttp_client) on a real database."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.up import free_port
from tests.kv_redis import kv_redis_url  # noqa: F401
from tests.tenancy.db_support import db_url, pg_database, pg_url, sqlite_template, sqlite_url  # noqa: F401
from tests.upstreams import hf_checkpoint, transformers_server  # noqa: F401
from tests.worker_process import worker_process

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


# --- real worker processes (python -m worker --model random-tiny), shared by the session ----------------


@pytest.fixture(scope="session")
def worker_url(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("worker-a") / "worker.log"
    with worker_process("--model", "random-tiny", "--num-blocks", "4096", log_path=log_path) as url:
        yield url


@pytest.fixture(scope="session")
def second_worker_url(tmp_path_factory, worker_url):
    log_path = tmp_path_factory.mktemp("worker-b") / "worker.log"
    with worker_process("--model", "random-tiny", "--num-blocks", "4096", log_path=log_path) as url:
        yield url


@pytest.fixture
async def gateway(aiohttp_client, sqlite_url, tmp_path, worker_url):  # noqa: F811
    """The real gateway app in front of the real worker."""
    return await aiohttp_client(create_app(make_config(sqlite_url, tmp_path, worker_urls=(worker_url,))))


@pytest.fixture
async def sdk(gateway):
    """The real openai SDK as a new tenant of ``gateway``."""
    key = (await create_tenant(gateway))["api_key"]
    client = AsyncOpenAI(base_url=str(gateway.make_url("/v1")), api_key=key, max_retries=0)
    yield client
    await client.close()
