"""Replicas sharing a worker's KV events through the Redis relay converge whatever the stream misses.

Review r16 #2: a leader whose long poll outlived its lease still published its late batch, after the new
leader's batches; its stream position jumped past them and its index never got their events. A replica
reading a stream that lacks batches (trimmed, or never published) applied what came next as if it
continued: nothing checked that a relayed batch's first event follows the last one applied."""

from __future__ import annotations

import asyncio
import random
import secrets

import aiohttp
import pytest
import redis.asyncio as redis

from gateway.kv_consumer import KVEventConsumer, _Gap, relayed_part
from gateway.kv_index import PrefixIndex
from gateway.kv_relay import RedisKVRelay
from gateway.workers import WorkerPool
from tests.gateway.test_gateway_routing_kv import wait_until
from tests.gateway.test_gateway_routing_redis import store_blocks
from tests.tenancy.db_support import REDIS_ENV, service_url

RELAY = dict(lease_ms=600, timeout_s=5.0)


@pytest.fixture
def redis_url() -> str:
    return service_url(REDIS_ENV, "Redis")


@pytest.fixture
async def key_prefix(redis_url: str):
    prefix = f"test-relay-{secrets.token_hex(4)}"  # this test's own lease and stream
    yield prefix
    client = redis.from_url(redis_url)
    try:
        async for key in client.scan_iter(match=f"{prefix}:*"):
            await client.delete(key)
    finally:
        await client.aclose()


def _replica(session, worker_url: str, url: str, name: str, key_prefix: str):
    pool, index = WorkerPool((worker_url,), session), PrefixIndex()
    relay = RedisKVRelay(url, replica_id=name, key_prefix=key_prefix, **RELAY)
    return KVEventConsumer(pool, index, relay=relay, wait_ms=100, retry_s=0.05), pool, index


async def _newest_seq(session, worker_url: str) -> int:
    async with session.get(f"{worker_url}/v1/kv_events", params={"since": "0", "max_events": "1"}) as r:
        return (await r.json())["last_seq"]


def _blocks(index: PrefixIndex, worker_url: str) -> set[bytes]:
    state = index.workers.get(worker_url)
    return set() if state is None else set(state.blocks)


def _prompt() -> list[int]:
    return [random.randrange(1, 200) for _ in range(64)]  # new blocks, whatever the shared worker holds


def test_a_relayed_batch_is_applied_from_where_the_replica_is():
    def batch(*seqs: int, worker_id: str = "w1", **extra) -> dict:
        return {"worker_id": worker_id, "events": [{"seq": s, "type": "BlockRemoved"} for s in seqs], **extra}

    assert relayed_part(batch(5, 6), "w1", 4) == batch(5, 6)
    assert relayed_part(batch(3, 4, 5, 6), "w1", 4) == batch(5, 6)  # applied already: skipped
    assert relayed_part(batch(3, 4), "w1", 4) is None
    assert relayed_part(batch(1, 2, worker_id="w2"), "w1", 4) == batch(1, 2, worker_id="w2")  # restarted
    assert relayed_part(batch(worker_id="w1"), "w1", 4) == batch()  # no events: the load report
    paged = batch(9, reset=True, snapshot={"seq": 9})
    assert relayed_part(paged, "w1", 4) == paged
    for seqs, position in (((6, 7), ("w1", 4)), ((2,), (None, 0)), ((3,), ("w1", 0))):
        with pytest.raises(_Gap):
            relayed_part(batch(*seqs), *position)


async def test_publishing_needs_the_lease(redis_url, key_prefix):
    a = RedisKVRelay(redis_url, replica_id="A", key_prefix=key_prefix, **RELAY)
    b = RedisKVRelay(redis_url, replica_id="B", key_prefix=key_prefix, **RELAY)
    try:
        assert await a.lead("http://w") and not await b.lead("http://w")
        assert await b.publish("http://w", {"events": []}) is None
        entry_id = await a.publish("http://w", {"events": []})
        assert [e for e, _ in await b.read("http://w", "0", block_ms=None)] == [entry_id]
    finally:
        await a.close()
        await b.close()


async def test_a_late_leader_does_not_lose_the_new_leaders_batches(redis_url, worker_url, key_prefix):
    async with aiohttp.ClientSession() as session:
        a, pool_a, index_a = _replica(session, worker_url, redis_url, "A", key_prefix)
        b, _, index_b = _replica(session, worker_url, redis_url, "B", key_prefix)
        client_a = pool_a.client(worker_url)
        poll, hold, release = client_a.kv_events, asyncio.Event(), asyncio.Event()

        async def late_when_held(**kw):  # A's answer is late (a stalled link), past its lease
            batch = await poll(**kw)
            if hold.is_set() and batch.get("events"):
                await release.wait()
            return batch

        client_a.kv_events = late_when_held
        a.start()
        await wait_until(lambda: worker_url in a.leading)
        b.start()
        try:
            await store_blocks(session, worker_url, _prompt())
            seq = await _newest_seq(session, worker_url)
            await wait_until(
                lambda: min(index_a.position(worker_url)[1], index_b.position(worker_url)[1]) >= seq
            )
            hold.set()
            await store_blocks(session, worker_url, _prompt())  # A's poll gets these events and stalls
            await wait_until(lambda: worker_url in b.leading)  # A's lease expired: B polls and publishes
            await store_blocks(session, worker_url, _prompt())
            seq = await _newest_seq(session, worker_url)
            await wait_until(lambda: index_b.position(worker_url)[1] >= seq)
            release.set()  # A's late batch comes back: before, A published it after B's and skipped them
            await wait_until(lambda: _blocks(index_a, worker_url) == _blocks(index_b, worker_url))
            assert worker_url not in a.leading
        finally:
            await a.close()
            await b.close()


async def test_a_replica_reading_a_trimmed_stream_polls_the_worker_to_fill_the_gap(
    redis_url,
    worker_url,
    key_prefix,
):
    async with aiohttp.ClientSession() as session:
        a, _, index_a = _replica(session, worker_url, redis_url, "A", key_prefix)
        b, _, index_b = _replica(session, worker_url, redis_url, "B", key_prefix)
        a.start()
        try:
            await wait_until(lambda: worker_url in a.leading)
            await store_blocks(session, worker_url, _prompt())
            seq = await _newest_seq(session, worker_url)
            await wait_until(lambda: index_a.position(worker_url)[1] >= seq)
            stream = redis.from_url(redis_url)
            try:  # the batches B would need first are gone from the stream (trimmed, or never published)
                (stream_key,) = [k async for k in stream.scan_iter(match=f"{key_prefix}:*:events")]
                await stream.xtrim(stream_key, maxlen=0)
            finally:
                await stream.aclose()
            await store_blocks(session, worker_url, _prompt())
            b.start()
            seq = await _newest_seq(session, worker_url)
            await wait_until(lambda: index_b.position(worker_url)[1] >= seq)
            await wait_until(lambda: _blocks(index_b, worker_url) == _blocks(index_a, worker_url))
            assert worker_url not in b.leading and b.num_relay_gaps >= 1
        finally:
            await a.close()
            await b.close()
