"""Prefetches from disk and Redis: one tenant's burst does not queue another behind its reads, and what
waiting requests prefetched stays within the L2 budget."""

import asyncio
import threading

from tests.worker.conftest import greedy, prompt_of, run
from tests.worker.test_tier_faults import SlowLink
from tests.worker.test_tiers import BLOCK_BYTES, A, B
from worker.tiers.prefetch_queue import FairQueue


def test_fair_queue_serves_namespaces_in_turn_and_each_in_order():
    queue: FairQueue[str] = FairQueue()
    for i in range(4):
        queue.put("a", f"a{i}")
    queue.put("b", "b0")
    queue.put("c", "c0")
    queue.put("b", "b1")
    assert [queue.get() for _ in range(7)] == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]
    got: list[str | None] = []
    waiter = threading.Thread(target=lambda: got.append(queue.get()))
    waiter.start()  # waits for an item
    queue.put("d", "d0")
    waiter.join(timeout=5)
    assert got == ["d0"]
    queue.put("a", "late")
    queue.close()
    assert queue.get() is None  # closed: what was queued is dropped


async def test_one_tenants_cold_burst_does_not_queue_another_behind_its_redis_reads(
    make_engine, kv_redis_url
):
    """Every cold request asks Redis (0.2 s a reply through the link: a hit, not a fault). Before, B's one
    read waited behind all of A's burst (one FIFO for everyone): B finished after nearly all of A's."""
    port = int(kv_redis_url.split(":")[2].split("/")[0])
    db = kv_redis_url.rsplit("/", 1)[1]
    link = SlowLink(port, delay_s=0.2)
    burst = 16
    try:
        engine = make_engine(
            num_blocks=128, l2_bytes=64 * BLOCK_BYTES, remote_url=f"redis://127.0.0.1:{link.port}/{db}"
        )
        finished: list[str] = []

        async def request(rid: str, prompt: list[int], segs) -> None:
            await run(engine, rid, prompt, segs=segs, params=greedy(2))
            finished.append(rid)

        flood = [asyncio.create_task(request(f"a{i}", prompt_of(1000 + i, 48), A)) for i in range(burst)]
        await asyncio.sleep(0.05)  # A's prefetches are queued
        await request("b", prompt_of(501, 48), B)
        a_before_b = finished.index("b")
        await asyncio.gather(*flood)
        errors = engine.stats()["tiers"]["remote"].get("errors_total", 0)
    finally:
        link.close()
    assert errors == 0  # every read was answered in time: the queue, not a fault, made the wait
    assert a_before_b <= burst // 2, f"B finished after {a_before_b} of A's {burst} requests"
