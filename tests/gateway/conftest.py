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


# --- a real worker process (python -m worker --model random-tiny), shared by the session ---------------


def _spawn_worker(tmp_path_factory: pytest.TempPathFactory, name: str):
    import subprocess
    import sys
    import time
    import urllib.request

    port = free_port()
    log_path = tmp_path_factory.mktemp(name) / "worker.log"
    log_file = open(log_path, "wb")  # noqa: SIM115 - closed by the caller
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "worker",
            "--model",
            "random-tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-blocks",
            "4096",
        ],
        stdout=log_file,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"worker exited with {process.returncode}: {log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=1) as response:
                if response.status == 200:
                    return process, url, log_file
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"worker did not become healthy: {log_path.read_text()[-2000:]}")


def _stop_process(process, log_file) -> None:
    import subprocess

    process.terminate()
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    log_file.close()


@pytest.fixture(scope="session")
def worker_url(tmp_path_factory):
    process, url, log_file = _spawn_worker(tmp_path_factory, "worker-a")
    yield url
    _stop_process(process, log_file)


@pytest.fixture(scope="session")
def second_worker_url(tmp_path_factory, worker_url):
    process, url, log_file = _spawn_worker(tmp_path_factory, "worker-b")
    yield url
    _stop_process(process, log_file)


@pytest.fixture
async def gateway(aiohttp_client, sqlite_url, tmp_path, worker_url):  # noqa: F811
    """The real gateway app in front of the real worker."""
    return await aiohttp_client(create_app(make_config(sqlite_url, tmp_path, worker_urls=(worker_url,))))
