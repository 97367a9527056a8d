"""A purge fences work that started before it: a prefetch in flight, and requests already waiting or
running, must not bring blocks of the purged namespace back into any tier once the purge has answered."""

import asyncio
import itertools
import time

import pytest
import redis
import torch

import worker.engine as engine_mod
from policies.hashing import BlockHash
from tests.worker.conftest import greedy, prompt_of, run
from tests.worker.test_tier_faults import SlowLink
from tests.worker.test_tiers import BLOCK_BYTES, A, B
from worker.purge_fence import PurgeFence
from worker.tiers.entry import BlockRecord
from worker.tiers.host import DemotedBlock


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


def test_work_starting_while_a_purge_runs_is_fenced_until_and_after_it_ends():
    """r4: a request arriving after purge_started got the purge's own generation as its tag, so a prefetch
    that read Redis before the erase and landed before purge_done was not fenced."""
    fence = PurgeFence()
    fence.purge_started("t-a")
    during = fence.tag()
    assert fence.purged_since("t-a", during)
    fence.purge_started("t-b")  # two purges overlap: A's end must not forget B's, still running
    fence.purge_done("t-a", live_tags=[during])
    assert fence.purged_since("t-b", fence.tag()) and fence.purged_since("t-a", during)
    fence.purge_done("t-b", live_tags=[])
    assert not fence.purged_since("t-b", fence.tag()) and fence._purged_at == {}


async def test_a_prefetch_started_and_landed_during_the_redis_erase_is_dropped(
    make_engine, kv_redis_url, monkeypatch
):
    """r4: a request arriving 0.3 s into a purge (Redis erase still running) was served 64 tokens from
    Redis blocks the purge then reported erased, and left 5 of them in L2."""
    producer = make_engine(num_blocks=24, l2_bytes=4 * BLOCK_BYTES, remote_url=kv_redis_url)
    prompt = prompt_of(4141, 80)  # 5 full blocks of t-a
    await run(producer, "first", prompt, segs=A)
    for i in range(6):  # push t-a's blocks out to Redis
        await run(producer, f"filler-{i}", prompt_of(9100 + i, 80), segs=B)
    producer.store.wait_for_writes()
    real = engine_mod.purge_remote

    async def slow_erase(*args):  # the Redis erase SCANs a shared keyspace: it takes a while
        await asyncio.sleep(1.0)
        await real(*args)

    monkeypatch.setattr(engine_mod, "purge_remote", slow_erase)
    consumer = make_engine(num_blocks=64, l2_bytes=64 * BLOCK_BYTES, remote_url=kv_redis_url)
    purge = asyncio.create_task(consumer.purge("t-a"))
    await asyncio.sleep(0.3)  # L1, L2, L3 erased, fence up; Redis not yet erased
    _, usage, _ = await run(consumer, "during", prompt, segs=A)  # its prefetch reads Redis and lands
    erased, failed = await purge
    assert not failed and erased.get("remote") == 5
    assert usage["cached_tokens_by_source"].get("remote", 0) == 0, usage
    assert _blocks_of(consumer, "t-a") == (0, 0)


async def test_a_cancelled_purge_keeps_its_fence_until_the_redis_erase_ends(
    make_engine, kv_redis_url, monkeypatch
):
    """The /v1/purge handler may be cancelled (client gone) while Redis is erased off the engine thread: the
    fence must stay up until the erase itself ends, not drop when the handler unwinds."""
    engine = make_engine(num_blocks=24, l2_bytes=4 * BLOCK_BYTES, remote_url=kv_redis_url)
    real, ended = engine_mod.purge_remote, asyncio.Event()

    async def slow_erase(*args):
        await asyncio.sleep(0.5)
        await real(*args)
        ended.set()

    monkeypatch.setattr(engine_mod, "purge_remote", slow_erase)
    purge = asyncio.create_task(engine.purge("t-a"))
    await asyncio.sleep(0.2)
    purge.cancel()
    await asyncio.sleep(0.1)  # the engine thread has had time to run any purge_done posted on cancel
    assert engine.purge_fence.purged_since("t-a", engine.purge_fence.tag())
    await asyncio.wait_for(ended.wait(), 5)
    await asyncio.sleep(0.1)
    assert not engine.purge_fence.purged_since("t-a", engine.purge_fence.tag())


async def test_a_purge_posted_after_the_engine_stopped_is_answered_at_once(make_engine, tmp_path):
    """r5: once the engine loop had exited, the purge command never ran and purge() waited forever (the
    worker's /v1/purge hung during shutdown). Now it answers at once that nothing was erased."""
    engine = make_engine(l3_dir=tmp_path / "kv", l3_min_free_bytes=0, l2_bytes=1 << 20)
    await run(engine, "fill", prompt_of(1, 64), segs=A, params=greedy(1))
    await asyncio.to_thread(engine.stop)  # the worker's cleanup_ctx stops the engine
    purge = asyncio.ensure_future(engine.purge("t-a"))
    done, _ = await asyncio.wait([purge], timeout=5)
    assert done, "purge() never answered after the engine stopped"
    erased, failed = purge.result()
    assert erased == {} and "stopping" in failed["local"], (erased, failed)
    assert not engine._purges


@pytest.mark.parametrize("posted", [False, True])
async def test_purges_racing_the_engine_stop_are_all_answered(make_engine, tmp_path, posted):
    """A purge posted just before stop() may find the loop already gone: stop() fails what it left."""
    engine = make_engine(l3_dir=tmp_path / "kv", l3_min_free_bytes=0, l2_bytes=1 << 20)
    await run(engine, "fill", prompt_of(1, 64), segs=A, params=greedy(1))
    purges = [asyncio.ensure_future(engine.purge(ns)) for ns in ("t-a", "t-b", "t-a")]
    if posted:  # their commands are in the inbox before stop() begins
        await asyncio.sleep(0)
    await asyncio.to_thread(engine.stop)
    done, _ = await asyncio.wait(purges, timeout=5)
    assert len(done) == len(purges), "a purge never answered across the engine stop"
    for purge in purges:
        erased, failed = purge.result()
        assert failed == {} or "stopping" in failed["local"], (erased, failed)


async def _stream_gaps(engine, request_id: str, on_token=None) -> list[float]:
    """Seconds between the outputs of one long greedy stream of tenant t-b."""
    stamps: list[float] = []
    async for out in engine.generate(request_id, prompt_of(7, 20), greedy(120), B):
        assert out.error is None, out.error
        stamps.append(time.monotonic())
        if on_token is not None:
            on_token(len(stamps))
    return [later - earlier for earlier, later in itertools.pairwise(stamps)]


async def test_purging_one_tenant_does_not_stall_another_tenants_stream(make_engine, kv_redis_url, tmp_path):
    """r7 #1: the purge drained the whole demotion write queue (every tenant's disk and Redis writes) on
    the engine thread: with Redis behind a slow link and t-a's chunks queued, t-b's stream froze 7 s. The
    purge now waits for the writer off the engine thread, and the writer drops t-a's queued blocks."""
    port = int(kv_redis_url.split(":")[2].split("/")[0])
    link = SlowLink(port, delay_s=0.15)  # a busy Redis host: every write succeeds, slowly
    try:
        engine = make_engine(
            num_blocks=24,
            l2_bytes=4 * BLOCK_BYTES,
            remote_url=f"redis://127.0.0.1:{link.port}/{kv_redis_url.rsplit('/', 1)[1]}",
            remote_timeout_ms=5000,  # no timeout (and no paused tier, no failed purge) on a loaded machine
            l3_dir=tmp_path / "kv",
            l3_min_free_bytes=0,
        )
        control = await _stream_gaps(engine, "b-control")  # t-b's stream with nothing else going on
        for i in range(30):  # t-a's evicted blocks pass L2 and queue for L3 and Redis
            await run(engine, f"a-{i}", prompt_of(100 + i, 80), segs=A, params=greedy(1))
        queued = engine.store._writes.qsize()
        purges: list[asyncio.Future] = []

        def purge_at_fifth_token(num_outputs: int) -> None:
            if num_outputs == 5:
                purges.append(asyncio.ensure_future(engine.purge("t-a")))

        gaps = await _stream_gaps(engine, "b-during", purge_at_fifth_token)
        erased, failed = await purges[0]
        await asyncio.to_thread(engine.store.wait_for_writes)
    finally:
        link.close()
    assert queued >= 10, queued  # the stall this test guards against grows with the queue (7 s at 30)
    assert max(gaps) < max(1.5, 5 * max(control)), (max(gaps), max(control), queued)
    # The purge still erased everything: no queued write of t-a landed after it, in L3 or in Redis.
    assert not failed and {"l1", "l2", "l3", "remote"} <= erased.keys(), (erased, failed)
    assert _blocks_of(engine, "t-a") == (0, 0)
    assert not [f for f in (tmp_path / "kv").rglob("*.kv") if "t-a" in f.parts], "t-a files on disk"
    client = redis.Redis.from_url(kv_redis_url)
    assert not list(client.scan_iter(match=f"{engine.store.remote.prefix}:t-a:*")), "t-a blocks in Redis"


async def test_purges_leave_no_record_on_a_quiet_worker(make_engine, tmp_path):
    """r10 #3: each purge recorded its namespace for the demotion writer, forgotten only when the writer
    took a chunk queued after it: a worker whose caches never spill to L3 kept one record per namespace
    ever purged (200 purges, 200 records)."""
    engine = make_engine(num_blocks=64, l2_bytes=1 << 20, l3_dir=tmp_path / "kv", l3_min_free_bytes=0)
    await run(engine, "warm", prompt_of(1, 40), segs=A, params=greedy(1))
    for k in range(200):  # tenants deleted over the worker's life (a new namespace id per epoch)
        _, failed = await engine.purge(f"t-gone-{k}")
        assert not failed, failed
    await run(engine, "after", prompt_of(2, 40), segs=A, params=greedy(1))
    assert engine.store._purged_writes == {}


async def test_a_purge_is_forgotten_once_the_writes_queued_before_it_are_taken(make_engine, tmp_path):
    """r10 #3: a purge made while writes were queued stays recorded (they must be filtered), and is
    forgotten once the writer has taken them, without waiting for a write queued after it."""
    engine = make_engine(num_blocks=64, l2_bytes=1 << 20, l3_dir=tmp_path / "kv", l3_min_free_bytes=0)
    store = engine.store
    await asyncio.to_thread(store.wait_for_writes)  # the writer idle, every count settled
    block = DemotedBlock(
        record=BlockRecord(
            block_hash=BlockHash(b"q" * 32), parent_hash=None, token_ids=(1,) * store.block_size
        ),
        namespace_id="t-gone",
        position=0,
        data=torch.zeros(store.block_shape, dtype=store.dtype),
    )
    with store._chunk_written:  # the writer cannot filter a chunk meanwhile
        store._enqueue_demotion([block])
        store.purge_local("t-gone")
        assert "t-gone" in store._purged_writes  # the queued chunk must still be filtered
    await asyncio.to_thread(store.wait_for_writes)
    assert store._purged_writes == {}
    assert block.record.block_hash not in store.disk  # and it was: the purged block never reached L3
