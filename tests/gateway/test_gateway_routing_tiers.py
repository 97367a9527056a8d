"""KV-aware routing on what survives below the device pool, with real worker processes: the disk a
restarted worker finds (L3 events at start-up) and the Redis tier shared by workers (``remote`` events,
credited to every worker on that Redis). In both tests the worker holding the prompt is *not* the one
the cold fallback (rendezvous hash) picks, so only the tier events can route the request there."""

from __future__ import annotations

import contextlib
import random

import aiohttp
import pytest
from openai import AsyncOpenAI

from gateway.app import create_app
from gateway.state import PREFIX_INDEX, WORKER_POOL
from tests.gateway.conftest import create_tenant, make_config
from tests.gateway.test_gateway_e2e import MODEL
from tests.gateway.test_gateway_routing_kv import holders, wait_until
from tests.worker_process import free_port, worker_process

BLOCK = 16


async def complete(sdk: AsyncOpenAI, prompt: list[int]) -> int:
    answer = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    return answer.usage.prompt_tokens_details.cached_tokens


async def restarted(client, index, url: str, old_worker_id: str | None) -> None:
    """Wait until the gateway sees the new process at ``url`` healthy and follows its events."""
    pool = client.app[WORKER_POOL]
    await wait_until(lambda: pool.workers[url].healthy, timeout_s=15)
    await wait_until(
        lambda: url in index.workers and index.workers[url].worker_id not in (None, old_worker_id),
        timeout_s=15,
    )


async def test_gateway_routes_to_the_restarted_worker_whose_disk_holds_the_prompt(
    aiohttp_client, sqlite_url, tmp_path
):
    ports = {f"http://127.0.0.1:{port}": port for port in (free_port(), free_port())}
    args = ("--model", MODEL, "--num-blocks", "256", "--max-model-len", "1024", "--l3-min-free-bytes", "0")
    disks = {url: tmp_path / f"disk-{i}" for i, url in enumerate(ports)}
    config = make_config(sqlite_url, tmp_path, worker_urls=tuple(ports))
    client = await aiohttp_client(create_app(config))
    index = client.app[PREFIX_INDEX]
    rng = random.Random(11)
    prompt = [rng.randrange(1, 200) for _ in range(5 * BLOCK + 8)]
    with contextlib.ExitStack() as first_run:
        for url, port in ports.items():
            first_run.enter_context(
                worker_process(
                    *args, "--l3-dir", str(disks[url]), port=port, log_path=tmp_path / f"{port}-1.log"
                )
            )
        await wait_until(lambda: set(index.workers) == set(ports), timeout_s=15)
        sdk = AsyncOpenAI(
            base_url=str(client.make_url("/v1")),
            api_key=(await create_tenant(client))["api_key"],
            max_retries=0,
        )
        assert await complete(sdk, prompt) == 0  # cold: the rendezvous hash picks the worker
        await wait_until(lambda: len(holders(index, 5)) == 1)
        (cold_pick,) = holders(index, 5)
        old_ids = {url: index.workers[url].worker_id for url in ports}
    # Both stop (a clean stop writes the cache to disk). They come back with the disks swapped: the
    # cold pick's address gets an empty disk, the other address the disk holding the prompt.
    (other,) = set(ports) - {cold_pick}
    with contextlib.ExitStack() as second_run:
        for url, disk in ((cold_pick, tmp_path / "disk-empty"), (other, disks[cold_pick])):
            second_run.enter_context(
                worker_process(
                    *args, "--l3-dir", str(disk), port=ports[url], log_path=tmp_path / f"{url[-5:]}-2.log"
                )
            )
        for url in ports:
            await restarted(client, index, url, old_ids[url])
        await wait_until(lambda: holders(index, 5) == {other})  # its disk, announced at start-up
        assert {m for b in index.workers[other].blocks.values() for m in b.media} == {"L3"}
        assert await complete(sdk, prompt) == 5 * BLOCK  # routed to the disk that holds it
        async with aiohttp.ClientSession() as session, session.get(f"{other}/v1/stats") as response:
            stats = await response.json()
        assert stats["tiers"]["hits_blocks"]["l3"] == 5
    await sdk.close()


async def fill_l1(url: str, rounds: int) -> None:
    """Unrelated prompts sent to one worker directly, so its earlier blocks leave L1 and L2 for Redis."""
    async with aiohttp.ClientSession() as session:
        for i in range(rounds):
            payload = {
                "request_id": f"filler-{i}",
                "prompt_token_ids": [(i * 37 + k * 11) % 199 + 1 for k in range(6 * BLOCK)],
                "namespace": [{"start_token": 0, "namespace_id": "filler", "key": "ab" * 16}],
                "sampling": {"max_tokens": 1, "temperature": 0},
            }
            async with session.post(f"{url}/v1/generate", json=payload) as response:
                assert response.status == 200, await response.text()


async def test_redis_blocks_route_to_another_worker_sharing_that_redis(
    aiohttp_client, sqlite_url, tmp_path, kv_redis_url
):
    ports = {f"http://127.0.0.1:{port}": port for port in (free_port(), free_port())}
    small = ("--model", MODEL, "--num-blocks", "24", "--max-model-len", "368", "--l2-bytes", "1")
    config = make_config(sqlite_url, tmp_path, worker_urls=tuple(ports))
    client = await aiohttp_client(create_app(config))
    index = client.app[PREFIX_INDEX]
    rng = random.Random(12)
    prompt = [rng.randrange(1, 200) for _ in range(5 * BLOCK + 8)]
    with contextlib.ExitStack() as workers:
        stacks = {url: workers.enter_context(contextlib.ExitStack()) for url in ports}
        for url, port in ports.items():
            stacks[url].enter_context(
                worker_process(
                    *small, "--remote-url", kv_redis_url, port=port, log_path=tmp_path / f"{port}.log"
                )
            )
        await wait_until(lambda: set(index.workers) == set(ports), timeout_s=15)
        tier_ids = {index.workers[url].remote_tier for url in ports}
        assert len(tier_ids) == 1 and None not in tier_ids  # one Redis, one tier id
        (tier_id,) = tier_ids
        sdk = AsyncOpenAI(
            base_url=str(client.make_url("/v1")),
            api_key=(await create_tenant(client))["api_key"],
            max_retries=0,
        )
        assert await complete(sdk, prompt) == 0
        await wait_until(lambda: len(holders(index, 5)) == 1)
        (cold_pick,) = holders(index, 5)
        (other,) = set(ports) - {cold_pick}
        namespace_id = next(iter(index.workers[cold_pick].blocks.values())).namespace_id

        def in_redis() -> int:
            return sum(b.namespace_id == namespace_id for b in index.shared.get(tier_id, {}).values())

        await fill_l1(cold_pick, rounds=8)
        await wait_until(lambda: in_redis() >= 5, timeout_s=15)  # the cold pick wrote it to Redis
        # The cold pick comes back without Redis: only the other worker can restore the prompt now.
        old_id = index.workers[cold_pick].worker_id
        stacks[cold_pick].close()
        stacks[cold_pick].enter_context(
            worker_process(*small, port=ports[cold_pick], log_path=tmp_path / f"{ports[cold_pick]}-2.log")
        )
        await restarted(client, index, cold_pick, old_id)
        assert index.workers[cold_pick].remote_tier is None and not index.workers[other].blocks.keys() & {
            h for h, b in index.shared[tier_id].items() if b.namespace_id == namespace_id
        }  # the other worker never held the prompt itself: only Redis does
        assert await complete(sdk, prompt) == 5 * BLOCK
        async with aiohttp.ClientSession() as session, session.get(f"{other}/v1/stats") as response:
            stats = await response.json()
        assert stats["tiers"]["hits_blocks"]["remote"] == 5
    await sdk.close()


def test_index_credits_shared_redis_blocks_by_tier_id_namespace_and_ttl():
    from gateway.kv_index import TIER_WEIGHTS, PrefixIndex

    now = [100.0]
    index = PrefixIndex(clock=lambda: now[0])
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    stored = {
        "seq": 1,
        "type": "BlockStored",
        "medium": "remote",
        "block_hashes": [h1.hex()],
        "namespace_id": "t-a",
    }
    stored2 = {**stored, "seq": 2, "block_hashes": [h2.hex()], "parent_block_hash": h1.hex()}
    tier = {"id": "tier-1", "ttl_s": 60}
    index.apply("http://writer", {"worker_id": "w", "events": [stored, stored2], "remote_tier": tier})
    index.apply("http://peer", {"worker_id": "p", "events": [], "remote_tier": tier})
    index.apply("http://other-redis", {"worker_id": "o", "events": [], "remote_tier": {"id": "tier-2"}})
    index.apply("http://no-redis", {"worker_id": "n", "events": [], "remote_tier": None})
    found = index.match("http://peer", [h1, h2], ["t-a", "t-a"])
    assert (found.num_blocks, found.weighted_blocks) == (2, pytest.approx(2 * TIER_WEIGHTS["remote"]))
    for url in ("http://other-redis", "http://no-redis"):
        assert index.match(url, [h1, h2], ["t-a", "t-a"]).num_blocks == 0
    assert index.match("http://peer", [h1, h2], ["t-b", "t-b"]).num_blocks == 0  # another namespace
    # A worker's own L1 copy outweighs the shared one; a removal by any sharing worker applies to all.
    l1 = {"seq": 1, "type": "BlockStored", "medium": "L1", "block_hashes": [h1.hex()], "namespace_id": "t-a"}
    index.apply("http://peer", {"worker_id": "p", "events": [l1], "remote_tier": tier})
    assert index.match("http://peer", [h1, h2], ["t-a", "t-a"]).weighted_blocks == pytest.approx(1.0 + 0.3)
    removed = {"seq": 2, "type": "BlockRemoved", "medium": "remote", "block_hashes": [h2.hex()]}
    index.apply("http://peer", {"worker_id": "p", "events": [removed], "remote_tier": tier})
    assert index.match("http://writer", [h1, h2], ["t-a", "t-a"]).num_blocks == 1
    # The writer is dropped (dead): what it wrote is still in Redis, until the TTL passes unannounced.
    index.drop("http://writer")
    assert index.match("http://peer", [h1], ["t-a"]).num_blocks == 1
    index.drop("http://peer")
    index.apply("http://peer", {"worker_id": "p2", "events": [], "remote_tier": tier})
    assert index.match("http://peer", [h1], ["t-a"]).num_blocks == 1
    now[0] += 61
    assert index.match("http://peer", [h1], ["t-a"]).num_blocks == 0
