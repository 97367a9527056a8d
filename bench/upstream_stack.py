"""The processes the ``openai`` upstream benchmarks run against (bench.upstream_overhead and
bench.upstream_dead_url): a worker (``random-tiny``), an *upstream* prefixgate gateway in front of it
(the OpenAI-compatible server) and *front* gateways whose only model is that server as an ``openai``
upstream. Every gateway has its own data dir, SQLite database and namespace salt; the front gateways'
upstream key is a tenant of the upstream gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.gateway_overhead import ADMIN_TOKEN, create_tenant, wait_http
from gateway.up import free_port

MODEL = "random-tiny"
PUBLIC_MODEL = "bench-upstream"  # the front gateways' name for MODEL
UPSTREAM = "upstream"  # the upstream gateway's name (data dir and salt)
_KEY_ENV = "BENCH_UPSTREAM_KEY"


def gateway_process(env: dict[str, str], port: int, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "gateway", "gateway", "--port", str(port), *extra]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def upstream_tenant(upstream: str) -> str:
    """The front gateways' key: a tenant of the upstream gateway."""
    async with aiohttp.ClientSession() as session:
        return (await create_tenant(session, upstream, {"name": "front-gateway"}))["api_key"]


@dataclass(slots=True)
class UpstreamStack:
    upstream: str  # the upstream gateway's base URL
    front_key: str  # the front gateways' key to it
    envs: dict[str, dict[str, str]]  # each gateway's environment, by name
    processes: list[subprocess.Popen]  # stopped when the stack's context ends

    def start_front(self, name: str, spec: dict[str, Any]) -> str:
        """Start the front gateway ``name`` with ``spec`` (one ``openai`` upstream, its key added) as its
        only model source; its base URL once it answers."""
        env = self.envs[name] | {
            "PREFIXGATE_WORKER_URLS": "",
            "PREFIXGATE_OPENAI_UPSTREAMS": json.dumps([{**spec, "api_key_env": _KEY_ENV}]),
            _KEY_ENV: self.front_key,
        }
        port = free_port()
        self.processes.append(gateway_process(env, port))
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/healthz", self.processes[-1])
        return url


@contextlib.contextmanager
def upstream_stack(front_names: Iterable[str], *, log_level: str, tmp_prefix: str) -> Iterator[UpstreamStack]:
    """The worker and the upstream gateway, up; the front gateways' databases ready (start them with
    ``start_front``). Every process is stopped on exit."""
    with tempfile.TemporaryDirectory(prefix=tmp_prefix) as tmp:
        base = {**os.environ, "PREFIXGATE_ADMIN_TOKEN": ADMIN_TOKEN, "PREFIXGATE_LOG_LEVEL": log_level}
        envs = {
            name: {**base, "PREFIXGATE_DATA_DIR": str(Path(tmp) / name), "PREFIXGATE_NAMESPACE_SALT": name}
            for name in (UPSTREAM, *front_names)
        }
        for env in envs.values():
            upgrade = [sys.executable, "-m", "gateway", "db", "upgrade"]
            subprocess.run(upgrade, env=env, check=True, stdout=subprocess.DEVNULL)
        worker_port, up_port = free_port(), free_port()
        worker, upstream = f"http://127.0.0.1:{worker_port}", f"http://127.0.0.1:{up_port}"
        worker_cmd = [sys.executable, "-m", "worker", "--model", MODEL, "--port", str(worker_port)]
        up_env = envs[UPSTREAM]
        processes = [
            subprocess.Popen(worker_cmd, env=up_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
            gateway_process(up_env, up_port, "--worker-url", worker),
        ]
        try:
            wait_http(worker + "/healthz", processes[0])
            wait_http(upstream + "/healthz", processes[1])
            front_key = asyncio.run(upstream_tenant(upstream))
            yield UpstreamStack(upstream=upstream, front_key=front_key, envs=envs, processes=processes)
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(30)
