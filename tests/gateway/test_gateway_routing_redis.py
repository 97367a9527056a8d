"""Two gateway replicas share the workers' KV-event streams through Redis: one polls, both route."""

from __future__ import annotations

import random

import pytest

from gateway.app import create_app
from gateway.state import KV_CONSUMER, PREFIX_INDEX
from tests.gateway.conftest import make_config
from tests.gateway.test_gateway_routing_kv import wait_until
from tests.tenancy.db_support import REDIS_ENV, service_url

KEY = "00112233445566778899aabbccddeeff"


@pytest.fixture
def redis_url() -> str:
    return service_url(REDIS_ENV, "Redis")


async def store_blocks(session, worker_url: str, prompt: list[int]) -> None:
    payload = {
        "request_id": f"relay-{random.getrandbits(32)}",
        "prompt_token_ids": prompt,
        "namespace": [{"start_token": 0, "namespace_id": "t-relay", "key": KEY}],
        "sampling": {"max_tokens": 1, "temperature": 0},
    }
    async with session.post(f"{worker_url}/v1/generate", json=payload) as response:
        assert response.status == 200


async def test_one_replica_polls_each_worker_and_the_other_follows_through_redis(
    aiohttp_client, sqlite_url, tmp_path, worker_url, redis_url
):
    replicas = [
        await aiohttp_client(
            create_app(make_config(sqlite_url, tmp_path / n, worker_urls=(worker_url,), redis_url=redis_url))
        )
        for n in "ab"
    ]
    consumers = [replica.app[KV_CONSUMER] for replica in replicas]
    await wait_until(lambda: sum(worker_url in c.leading for c in consumers) == 1)
    leader = next(i for i, c in enumerate(consumers) if worker_url in c.leading)
    follower = 1 - leader

    def known(i: int) -> int:
        state = replicas[i].app[PREFIX_INDEX].workers.get(worker_url)
        return 0 if state is None else sum(b.namespace_id == "t-relay" for b in state.blocks.values())

    session = replicas[leader].session
    await store_blocks(session, worker_url, [random.randrange(1, 200) for _ in range(64)])
    await wait_until(lambda: known(leader) >= 4 and known(follower) >= 4)
    assert consumers[follower].num_relayed_batches > 0 and worker_url not in consumers[follower].leading

    # The leader goes away: the other replica takes the lease over and keeps its index current.
    await replicas[leader].close()
    await wait_until(lambda: worker_url in consumers[follower].leading, timeout_s=10)
    before = known(follower)
    await store_blocks(replicas[follower].session, worker_url, [random.randrange(1, 200) for _ in range(64)])
    await wait_until(lambda: known(follower) >= before + 4)
