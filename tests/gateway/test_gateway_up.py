"""`prefixgate up`: migrations, a bundled worker process, the gateway, a demo tenant; Ctrl-C stops all."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gateway.up import free_port


def start_up(data_dir: Path, port: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PREFIXGATE_ADMIN_TOKEN"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway",
            "up",
            "--model",
            "random-tiny",
            "--port",
            str(port),
            "--data-dir",
            str(data_dir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def read_banner(process: subprocess.Popen, timeout_s: float = 120) -> str:
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            break
        lines.append(line)
        if "Ctrl-C stops everything." in line:
            return "".join(lines)
    process.kill()
    pytest.fail("prefixgate up printed no banner:\n" + "".join(lines)[-3000:])


def stop(process: subprocess.Popen) -> int:
    process.send_signal(signal.SIGINT)
    try:
        return process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()


def post_json(url: str, body: dict, key: str) -> dict:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


@pytest.fixture
def processes():
    started: list[subprocess.Popen] = []
    yield started
    for process in started:  # a failed assertion must not leave a gateway and its worker running
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def test_up_serves_a_demo_tenant_and_stops_cleanly(tmp_path: Path, processes):
    data_dir, port = tmp_path / "data", free_port()
    process = start_up(data_dir, port)
    processes.append(process)
    banner = read_banner(process)
    key = re.search(r"demo tenant API key \(shown once\): (\S+)", banner).group(1)
    admin_token = re.search(r"admin token \(stored in .*\): (\S+)", banner).group(1)
    assert (data_dir / "admin_token").read_text().strip() == admin_token
    assert f"curl http://127.0.0.1:{port}/v1/chat/completions" in banner and "OpenAI(base_url=" in banner

    body = {
        "model": "random-tiny",
        "messages": [{"role": "user", "content": "Hello! " * 20}],
        "max_tokens": 2,
    }
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    assert post_json(url, body, key)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert post_json(url, body, key)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert stop(process) == 0

    # Second start: same data dir, the demo tenant and its key survive, nothing new is printed for it.
    process = start_up(data_dir, port)
    processes.append(process)
    banner = read_banner(process)
    assert "demo tenant exists" in banner and admin_token not in banner  # shown on creation only
    assert "shown only when it was created" in banner
    assert post_json(url, body, key)["object"] == "chat.completion"
    assert stop(process) == 0
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
