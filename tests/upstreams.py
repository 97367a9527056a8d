"""A real third-party OpenAI-compatible server for tests: ``transformers serve`` on our exported model.

``hf_checkpoint`` exports the built-in model to a tmp dir as a Hugging Face checkpoint
(``worker.export_hf``); ``transformers_server`` runs ``transformers serve`` on it offline
(``HF_HUB_OFFLINE=1``, CPU) on a free port and yields a ``ThirdPartyServer`` with the base URL (ending in
``/v1``, what the openai SDK and prefixgate's ``openai`` upstream take) and the model id to send. Both are
session-scoped: the server takes a few seconds to start. Imported by tests/gateway/conftest.py; skipped,
saying why, when transformers' ``serving`` extra (fastapi, uvicorn) is not installed (a failure under
``PREFIXGATE_REQUIRE_SERVICES=1``).

``blackhole`` and ``hung_server`` are the two faults of a dead URL that real kernel sockets give
without any server code: a connect timeout, and a server that takes the connection and never answers.

    docs/operations.md, "A local OpenAI-compatible test server"
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.worker_process import free_port

SERVE_START_TIMEOUT_S = 120.0
SERVE_STOP_TIMEOUT_S = 15.0


@dataclass(frozen=True, kw_only=True)
class ThirdPartyServer:
    base_url: str  # http://127.0.0.1:PORT/v1
    model_id: str  # the name to send as "model" (transformers serve names a local model by its path)
    checkpoint: Path  # the Hugging Face checkpoint directory it serves
    log_path: Path


def serving_missing() -> str | None:
    """Why ``transformers serve`` cannot run here, or None."""
    missing = [m for m in ("transformers", "fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    return f"transformers serve needs {', '.join(missing)} (pip install -e '.[test]')" if missing else None


def _serve_command() -> list[str]:
    # The console script sits next to this interpreter; fall back to PATH (an installed, non-venv setup).
    script = Path(sys.executable).with_name("transformers")
    return [str(script) if script.exists() else shutil.which("transformers") or "transformers", "serve"]


@contextlib.contextmanager
def transformers_serve(
    checkpoint: Path, *, log_path: Path, timeout_s: float = SERVE_START_TIMEOUT_S
) -> Iterator[ThirdPartyServer]:
    """Run ``transformers serve CHECKPOINT`` on a free port until the block exits.

    Readiness is ``GET /health`` answering 200 within ``timeout_s`` (the model is preloaded before the
    server listens); a process that exits first fails at once with its log's tail. Teardown sends SIGTERM
    and kills after ``SERVE_STOP_TIMEOUT_S``.
    """
    port = free_port()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "PYTHONUNBUFFERED": "1",
    }
    args = [str(checkpoint), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    args += ["--dtype", "float32", "--log-level", "info"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*_serve_command(), *args], stdout=log, stderr=log, env=env)
    root = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"transformers serve exited with code {proc.returncode}:\n{tail}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{root}/health", timeout=1) as reply:
                if reply.status == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"transformers serve not ready after {timeout_s} s (log: {log_path})")
            time.sleep(0.2)
        yield ThirdPartyServer(
            base_url=f"{root}/v1", model_id=str(checkpoint), checkpoint=checkpoint, log_path=log_path
        )
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=SERVE_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=SERVE_STOP_TIMEOUT_S)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory) -> Path:
    """The built-in model exported as a Hugging Face checkpoint (config, safetensors, tokenizer)."""
    from worker.export_hf import export_hf  # torch: imported only by the tests that use it

    return export_hf(tmp_path_factory.mktemp("hf-checkpoint") / "prefixgate-tiny-hf")


@pytest.fixture(scope="session")
def transformers_server(hf_checkpoint, tmp_path_factory) -> Iterator[ThirdPartyServer]:
    """``transformers serve`` on ``hf_checkpoint``, offline, for the whole session."""
    if reason := serving_missing():
        if os.environ.get("PREFIXGATE_REQUIRE_SERVICES") == "1":
            pytest.fail(reason + " (PREFIXGATE_REQUIRE_SERVICES=1)")
        pytest.skip(reason)
    log_path = tmp_path_factory.mktemp("transformers-serve") / "serve.log"
    with transformers_serve(hf_checkpoint, log_path=log_path) as server:
        yield server


@contextlib.contextmanager
def blackhole() -> Iterator[str]:
    """A base URL whose connections time out: a listener whose accept queue is full drops new SYNs."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    time.sleep(0.1)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        for sock in (*fillers, listener):
            sock.close()


@contextlib.contextmanager
def hung_server() -> Iterator[str]:
    """A base URL that takes TCP connections (the kernel accepts them) and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    finally:
        listener.close()
