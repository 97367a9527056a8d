"""Cached prompts and tenant data are readable by their owner only (issue 11: 0644 files in 0755 dirs)."""

import asyncio
import stat
import time
from pathlib import Path

from gateway.app import create_app
from migrations import upgrade_database
from tests.gateway.conftest import create_tenant, make_config
from tests.gateway.test_gateway_purge import (  # noqa: F401 - small_worker is a fixture
    ask,
    kv_files,
    short_prompt,
    small_worker,
)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_kv_files_are_0600_in_0700_directories(
    aiohttp_client,
    sqlite_url,
    tmp_path,
    small_worker,  # noqa: F811 - the imported fixture
):
    url, kv_dir, _ = small_worker
    gateway = await aiohttp_client(create_app(make_config(sqlite_url, tmp_path, worker_urls=(url,))))
    tenant = await create_tenant(gateway)
    deadline = time.monotonic() + 20
    while not kv_files(kv_dir, tenant["namespace_id"]):
        assert time.monotonic() < deadline, "blocks never reached the disk tier"
        await ask(gateway, tenant["api_key"], short_prompt())
        await asyncio.sleep(0.05)
    files = kv_files(kv_dir, tenant["namespace_id"])
    assert {mode(f) for f in files} == {0o600}
    directories = {f.parent for f in files} | {f.parent.parent for f in files} | {kv_dir}
    assert {mode(d) for d in directories} == {0o700}


def test_a_new_sqlite_database_is_0600(tmp_path):
    path = tmp_path / "data" / "prefixgate.db"
    upgrade_database(f"sqlite+aiosqlite:///{path}")
    assert mode(path) == 0o600
    for sidecar in (path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if sidecar.exists():
            assert mode(sidecar) == 0o600


async def test_an_existing_world_readable_database_is_tightened(aiohttp_client, sqlite_url, tmp_path):
    path = Path(sqlite_url.split("///", 1)[1])
    path.chmod(0o644)
    client = await aiohttp_client(create_app(make_config(sqlite_url, tmp_path)))
    await create_tenant(client)
    assert mode(path) == 0o600
