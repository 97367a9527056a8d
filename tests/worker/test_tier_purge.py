"""A purge fences work that started before it: a prefetch in flight, and requests already waiting or
running, must not bring blocks of the purged namespace back into any tier once the purge has answered."""

import asyncio

from tests.worker.conftest import greedy, prompt_of, run
from tests.worker.test_tier_faults import SlowLink
from tests.worker.test_tiers import BLOCK_BYTES, A, B
from worker.purge_fence import PurgeFence


def _blocks_of(engine, namespace_id: str) -> tuple[int, int]:
    """(L1 blocks, L2 blocks) cached under ``namespace_id``."""
    l1 = [b for b in engine.block_manager.blocks if b.block_hash and b.namespace_id == namespace_id]
    l2 = [b for b, _ in engine.store.l2.resident() if b.namespace_id == namespace_id]
    return len(l1), len(l2)


async def test_a_prefetch_in_flight_during_a_purge_brings_nothing_back(make_engine, kv_redis_url):
    port = int(kv_redis_url.split(":")[2].split("/")[0])
    db = kv_redis_url.rsplit("/", 1)[1]
    producer = make_engine(num_blocks=24, l2_bytes=4 * BLOCK_BYTES, remote_url=kv_redis_url)
    prompt = prompt_of(41, 80)  # 5 full blocks of tenant t-a
    await run(producer, "first", prompt, segs=A)
    for i in range(6):  # push t-a's blocks out of L1 and L2 into Redis (fillers in another namespace)
        await run(producer, f"filler-{i}", prompt_of(900 + i, 80), segs=B)
    producer.store.wait_for_writes()

    link = SlowLink(port, delay_s=0.3)  # a busy Redis host: the prefetch is still reading when the purge runs
    try:
        consumer = make_engine(
            num_blocks=64,
            l2_bytes=64 * BLOCK_BYTES,
            remote_url=f"redis://127.0.0.1:{link.port}/{db}",
            remote_timeout_ms=5000,
        )
        request = asyncio.create_task(run(consumer, "in-flight", prompt, segs=A))
        await asyncio.sleep(0.1)  # the request arrived; its prefetch from Redis is under way
        erased, failed = await consumer.purge("t-a")
        _, usage, _ = await request
    finally:
        link.close()
    assert not failed and erased.get("remote") == 5
    assert _blocks_of(consumer, "t-a") == (0, 0)
    assert usage["cached_tokens_by_source"].get("remote", 0) == 0  # served from what the purge erased: no


async def test_requests_waiting_at_a_purge_do_not_publish_the_namespace_again(make_engine):
    engine = make_engine(num_blocks=128, l2_bytes=64 * BLOCK_BYTES, max_num_seqs=1)
    await run(engine, "first", prompt_of(42, 80), segs=A)
    hog = asyncio.create_task(run(engine, "busy", prompt_of(43, 32), segs=B, params=greedy(1500)))
    while not engine.stats()["num_running"]:  # "busy" holds the only running slot
        await asyncio.sleep(0.01)
    waiting = asyncio.create_task(run(engine, "queued", prompt_of(44, 80), segs=A, params=greedy(20)))
    await asyncio.sleep(0.1)
    assert engine.stats()["num_waiting"] == 1
    erased, failed = await engine.purge("t-a")
    assert not failed and erased["l1"] == 5
    await hog
    await waiting  # computed its prompt (and generated) after the purge answered
    assert _blocks_of(engine, "t-a") == (0, 0)
    await run(engine, "after", prompt_of(45, 80), segs=A)  # a request after the purge caches as usual
    assert _blocks_of(engine, "t-a")[0] == 5


def test_the_fence_covers_the_whole_purge_and_forgets_what_no_work_predates():
    fence = PurgeFence()
    before = fence.tag()
    fence.purge_started("t-a")
    during = fence.tag()  # arrived while Redis was still being erased
    assert fence.purged_since("t-a", before) and not fence.purged_since("t-b", before)
    fence.purge_done("t-a", live_tags=[before, during])
    after = fence.tag()
    assert fence.purged_since("t-a", before) and fence.purged_since("t-a", during)
    assert not fence.purged_since("t-a", after)
    fence.purge_started("t-b")
    fence.purge_done("t-b", live_tags=[])  # no work under way: nothing to remember
    assert fence._purged_at == {}
