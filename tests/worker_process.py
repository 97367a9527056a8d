"""Start a real worker process (``python -m worker``) for integration tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def worker_process(
    *args: str, log_path: Path | None = None, timeout_s: float = 120.0, port: int | None = None
) -> Iterator[str]:
    """Run ``python -m worker --port P *args`` until the block exits; yields its base URL.

    ``port`` pins the port (to restart a worker at the same address); a free one is picked otherwise.
    """
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed below
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker", "--port", str(port), *args], stdout=log, stderr=log, env=env
    )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited with code {proc.returncode} (log: {log_path})")
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("worker did not become healthy")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log_path:
            log.close()
