"""Schemathesis against the gateway's own OpenAPI document: no generated request gets a 5xx (issue 11).

The real gateway (its own thread and event loop, real SQLite, the session's real worker process) is called
over HTTP with generated requests for every operation: tenant routes with a tenant key, admin routes with
the admin token. Examples are bounded so the run stays short.
"""

import asyncio
import threading

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings

from gateway.app import create_app
from gateway.openapi import openapi_spec
from gateway.up import _serve, free_port
from tests.gateway.conftest import ADMIN, make_config

SCHEMA = schemathesis.openapi.from_dict(openapi_spec())


@pytest.fixture(scope="module")
def live_gateway(tmp_path_factory, sqlite_template, worker_url):
    import shutil

    data_dir = tmp_path_factory.mktemp("schemathesis-gateway")
    shutil.copy(sqlite_template, data_dir / "prefixgate.db")
    config = make_config(
        f"sqlite+aiosqlite:///{data_dir / 'prefixgate.db'}",
        data_dir,
        worker_urls=(worker_url,),
        port=free_port(),
    )
    loop = asyncio.new_event_loop()
    ready, stop = threading.Event(), None

    def run() -> None:
        nonlocal stop
        asyncio.set_event_loop(loop)
        stop = asyncio.Event()

        async def main() -> None:
            serving = await _serve(create_app(config), config)
            ready.set()
            await stop.wait()
            await serving.cleanup()

        loop.run_until_complete(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30)
    base = f"http://{config.host}:{config.port}"
    created = requests.post(f"{base}/admin/v1/tenants", json={"name": "fuzz"}, headers=ADMIN, timeout=10)
    assert created.status_code == 201, created.text
    yield base, created.json()["api_key"]
    loop.call_soon_threadsafe(stop.set)
    thread.join(30)


@SCHEMA.parametrize()
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_generated_request_gets_a_5xx(case, live_gateway):
    base, api_key = live_gateway
    token = (
        ADMIN["Authorization"]
        if case.path.startswith("/admin") or case.path == "/metrics"
        else f"Bearer {api_key}"
    )
    response = case.call(base_url=base, headers={"Authorization": token}, timeout=30)
    assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:500])
