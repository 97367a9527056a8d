"""Optional encryption at rest of the disk and Redis tiers (issue 11: token ids were in clear there)."""

import asyncio
import os
import time

import pytest

from gateway.app import create_app
from tests.gateway.conftest import create_tenant, make_config
from tests.gateway.test_gateway_purge import ask, kv_files, redis_keys, short_prompt
from tests.tenancy.db_support import REDIS_ENV
from tests.worker_process import free_port, worker_process
from worker.tiers.at_rest import MAGIC, AtRestCipher
from worker.tiers.entry import CorruptEntry

KEY = "at-rest-secret-of-this-deployment"


def worker_args(tmp_path, redis_url, key=KEY) -> list[str]:
    args = ["--model", "random-tiny", "--num-blocks", "40", "--max-model-len", "512", "--l2-bytes", "16384"]
    args += ["--data-dir", str(tmp_path / "worker"), "--l3-min-free-bytes", "0", "--at-rest-key", key]
    if redis_url:
        args += ["--remote-url", redis_url, "--remote-ttl-s", "300"]
    return args


async def test_disk_and_redis_entries_are_sealed_and_survive_a_restart(aiohttp_client, sqlite_url, tmp_path):
    redis_url = os.environ.get(REDIS_ENV)
    kv_dir, port = tmp_path / "worker" / "kv", free_port()
    prompts = [short_prompt() for _ in range(3)]
    with worker_process(*worker_args(tmp_path, redis_url), port=port, log_path=tmp_path / "w1.log") as url:
        gateway = await aiohttp_client(create_app(make_config(sqlite_url, tmp_path, worker_urls=(url,))))
        tenant = await create_tenant(gateway)
        for prompt in prompts:
            await ask(gateway, tenant["api_key"], prompt)
        deadline = time.monotonic() + 20
        while not kv_files(kv_dir, tenant["namespace_id"]):
            assert time.monotonic() < deadline, "blocks never reached the disk tier"
            await ask(gateway, tenant["api_key"], short_prompt())
            await asyncio.sleep(0.05)
        for path in kv_files(kv_dir, tenant["namespace_id"]):
            data = path.read_bytes()
            assert data.startswith(MAGIC) and b'"tokens"' not in data and b"PGKV" not in data
        if redis_url:
            import redis

            client = redis.Redis.from_url(redis_url)
            values = [client.get(k) for k in redis_keys(redis_url, tenant["namespace_id"])]
            client.close()
            assert values and all(v.startswith(MAGIC) and b'"tokens"' not in v for v in values if v)
    # Restart with the same secret: the sealed files are indexed again and served.
    with worker_process(*worker_args(tmp_path, None), port=port, log_path=tmp_path / "w2.log"):
        result = await ask(gateway, tenant["api_key"], prompts[0])
        assert result["usage"]["prefixgate"]["cached_tokens_by_tier"]["l3"] > 0


def test_a_sealed_entry_opens_only_with_its_secret_and_namespace():
    cipher = AtRestCipher(KEY)
    sealed = cipher.seal("t-alice", b"PGKV entry with token ids")
    assert cipher.open(sealed) == ("t-alice", b"PGKV entry with token ids")
    with pytest.raises(CorruptEntry):
        AtRestCipher("another-deployment-secret").open(sealed)
    moved = sealed.replace(b"t-alice", b"t-bobby")  # claim another namespace
    with pytest.raises(CorruptEntry):
        cipher.open(moved)
    with pytest.raises(CorruptEntry):
        cipher.open(b"PGKV plain entry")
