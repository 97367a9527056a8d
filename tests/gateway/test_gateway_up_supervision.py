"""`prefixgate up` supervises its worker: restart when it dies, no orphan when `up` dies, one `up` per
data dir. Real processes throughout."""

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

from gateway.up import free_port
from tests.gateway.test_gateway_up import processes, read_banner, start_up, stop  # noqa: F401


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def healthz(port: int) -> dict:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())
    except OSError:
        return {}


def test_up_restarts_a_dead_worker_and_refuses_a_second_up(tmp_path, processes):  # noqa: F811
    data_dir, port = tmp_path / "data", free_port()
    up = start_up(data_dir, port)
    processes.append(up)
    read_banner(up)
    (worker,) = children(up.pid)

    second = start_up(data_dir, free_port())
    processes.append(second)
    output, _ = second.communicate(timeout=60)
    assert second.returncode == 2 and "another `prefixgate up`" in output and str(up.pid) in output

    os.kill(worker, signal.SIGKILL)
    assert wait_until(lambda: healthz(port).get("workers_healthy") == 0, 10)
    assert wait_until(lambda: healthz(port).get("workers_healthy") == 1, 60), "worker not restarted"
    assert up.poll() is None
    (restarted,) = children(up.pid)
    assert restarted != worker
    assert stop(up) == 0
    assert wait_until(lambda: not alive(restarted), 5)


def test_worker_dies_with_a_killed_up(tmp_path, processes):  # noqa: F811
    up = start_up(tmp_path / "data", free_port())
    processes.append(up)
    read_banner(up)
    (worker,) = children(up.pid)
    up.kill()
    up.wait(10)
    assert wait_until(lambda: not alive(worker), 10), "orphan worker left running"
    # The data dir is free again: a new `up` starts on it.
    again = start_up(tmp_path / "data", free_port())
    processes.append(again)
    read_banner(again)
    assert stop(again) == 0


def test_up_refuses_busy_ports_instead_of_using_what_listens_there(tmp_path, processes):  # noqa: F811
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        gateway_busy = start_up(tmp_path / "a", port)
        processes.append(gateway_busy)
        output, _ = gateway_busy.communicate(timeout=60)
        assert gateway_busy.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in output
        worker_busy = subprocess.run(
            [
                *(sys.executable, "-m", "gateway", "up", "--model", "random-tiny"),
                *("--port", str(free_port()), "--worker-port", str(port), "--data-dir", str(tmp_path / "b")),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert worker_busy.returncode == 2 and f"worker port {port} is in use" in worker_busy.stderr
