"""A worker that dies makes requests fail with 503; when it comes back the gateway finds it again."""

import asyncio
import contextlib
import subprocess
import sys
import time
import urllib.request

from gateway.app import create_app
from gateway.up import free_port
from tests.gateway.conftest import ADMIN, create_tenant, make_config
from tests.gateway.test_gateway_e2e import auth, chat_body


@contextlib.contextmanager
def worker_on(port: int):
    """A worker on a fixed port (tests/worker_process.py picks its own), so it can come back there."""
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "worker",
            "--model",
            "random-tiny",
            "--num-blocks",
            "512",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, f"worker exited with {process.returncode}"
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, "worker did not become healthy"
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def workers(gateway) -> list[dict]:
    return (await (await gateway.get("/admin/v1/workers", headers=ADMIN)).json())["data"]


async def test_worker_restart_is_detected(aiohttp_client, sqlite_url, tmp_path):
    port = free_port()
    with worker_on(port) as url:
        config = make_config(sqlite_url, tmp_path, worker_urls=(url,), worker_health_interval_s=0.2)
        gateway = await aiohttp_client(create_app(config))
        key = (await create_tenant(gateway))["api_key"]
        assert (
            await gateway.post("/v1/chat/completions", json=chat_body("hi"), headers=auth(key))
        ).status == 200
        first_id = (await workers(gateway))[0]["worker_id"]

    down = await gateway.post("/v1/chat/completions", json=chat_body("hi"), headers=auth(key))
    assert down.status == 503 and (await down.json())["error"]["type"] == "service_unavailable"
    for _ in range(50):
        if not (await workers(gateway))[0]["healthy"]:
            break
        await asyncio.sleep(0.1)
    assert (await gateway.get("/healthz")).status == 503

    with worker_on(port):
        for _ in range(100):
            state = (await workers(gateway))[0]
            if state["healthy"]:
                break
            await asyncio.sleep(0.1)
        assert state["healthy"] and state["worker_id"] != first_id
        assert (
            await gateway.post("/v1/chat/completions", json=chat_body("hi"), headers=auth(key))
        ).status == 200
