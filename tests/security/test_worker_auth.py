"""The worker API answers the gateways only (issue 11: it had no authentication)."""

import json
import urllib.error
import urllib.request

import pytest

from gateway.app import create_app
from tests.gateway.conftest import create_tenant, make_config
from tests.gateway.test_gateway_e2e import chat, chat_body, unique_system_prompt
from tests.worker_process import worker_process
from worker.config import WorkerConfig
from worker.server import create_app as create_worker_app

SECRET = "worker-shared-secret"


@pytest.fixture(scope="module")
def guarded_worker(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("guarded") / "worker.log"
    with worker_process("--model", "random-tiny", "--shared-secret", SECRET, log_path=log_path) as url:
        yield url


def status(url: str, headers: dict[str, str] | None = None, body: dict | None = None) -> int:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_calls_without_the_secret_are_refused(guarded_worker):
    purge = {"namespace_id": "t-victim"}
    assert status(f"{guarded_worker}/v1/purge", body=purge) == 401
    assert status(f"{guarded_worker}/v1/info") == 401
    assert status(f"{guarded_worker}/v1/info", {"Authorization": "Bearer wrong"}) == 401
    assert status(f"{guarded_worker}/v1/info", {"Authorization": f"Bearer {SECRET}"}) == 200
    assert status(f"{guarded_worker}/healthz") == 200  # liveness probes carry no secret


async def test_the_gateway_sends_the_secret(aiohttp_client, sqlite_url, tmp_path, guarded_worker):
    config = make_config(sqlite_url, tmp_path, worker_urls=(guarded_worker,), worker_secret=SECRET)
    gateway = await aiohttp_client(create_app(config))
    tenant = await create_tenant(gateway)
    result = await chat(gateway, tenant["api_key"], chat_body(unique_system_prompt()))
    assert result["usage"]["prompt_tokens"] > 0


def test_a_worker_bound_beyond_loopback_needs_a_secret():
    with pytest.raises(ValueError, match="without authentication"):
        create_worker_app(WorkerConfig(model="random-tiny", host="0.0.0.0"))
    create_worker_app(WorkerConfig(model="random-tiny", host="0.0.0.0", shared_secret=SECRET))  # fine
    create_worker_app(WorkerConfig(model="random-tiny", host="127.0.0.1"))  # fine
