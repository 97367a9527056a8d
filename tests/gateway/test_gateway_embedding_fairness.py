"""The near-miss embedder's queues: urgent embeddings never wait for background ones, and tenants take
turns in the background queue, so a tenant flooding distinct prompts cannot starve another's.

Order and counts are asserted, not wall time: the background thread is held by a gate (a job that waits
on an event) while the queue fills, then released, and the real int8 model embeds in queue order."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from gateway.embedding import EmbeddingShed, FairQueue, PromptEmbedder, _Job
from gateway.metrics import GatewayMetrics
from tests.gateway.test_gateway_near_miss import embedding_cache  # noqa: F401 - fixture

HANG_GUARD_S = 60  # only against a hang: nothing here waits on a deadline


def jobs_in_pop_order(queue: FairQueue) -> list[str]:
    order = []
    while (job := queue.pop()) is not None:
        order.append(job.args[0])
    return order


def test_fair_queue_serves_tenants_round_robin_in_fifo_order_within_each():
    queue = FairQueue()
    for i in range(5):
        assert queue.put("flood", _Job(print, (f"flood{i}",)))
    assert queue.put("quiet", _Job(print, ("quiet0",)))
    assert queue.put("other", _Job(print, ("other0",)))
    assert queue.put("quiet", _Job(print, ("quiet1",)))
    assert len(queue) == 8
    assert jobs_in_pop_order(queue) == [
        "flood0", "quiet0", "other0", "flood1", "quiet1", "flood2", "flood3", "flood4",
    ]  # fmt: skip
    assert len(queue) == 0 and queue.pop() is None


def test_fair_queue_caps_each_tenant_separately():
    queue = FairQueue(per_tenant=3)
    accepted = [queue.put("flood", _Job(print, (f"flood{i}",))) for i in range(10)]
    assert accepted == [True] * 3 + [False] * 7
    assert queue.put("quiet", _Job(print, ("quiet0",)))  # the flood's cap is its own
    assert queue.depth("flood") == 3 and queue.depth("quiet") == 1
    assert jobs_in_pop_order(queue) == ["flood0", "quiet0", "flood1", "flood2"]
    assert queue.put("flood", _Job(print, ("flood3",)))  # room again once served


def hold_background(embedder: PromptEmbedder) -> threading.Event:
    """Occupy the background thread (running, not queued) until the returned event is set."""
    running, gate = threading.Event(), threading.Event()

    def hold() -> None:
        running.set()
        gate.wait()

    assert embedder._background.submit("gate", hold) is not None
    assert running.wait(HANG_GUARD_S)
    return gate


async def test_a_flooding_tenant_does_not_starve_a_quiet_ones_background_embeddings(embedding_cache):  # noqa: F811
    metrics = GatewayMetrics()
    embedder = PromptEmbedder(cache_dir=embedding_cache, background_per_tenant=8, metrics=metrics)
    await embedder.warm_up()
    gate = hold_background(embedder)
    done: list[str] = []

    async def remember(tenant: str, i: int) -> None:
        await embedder.embed(f"{tenant} prompt head number {i}, distinct text", urgent=False, tenant=tenant)
        done.append(f"{tenant}{i}")

    flood = [asyncio.create_task(remember("flood", i)) for i in range(30)]
    await asyncio.sleep(0)  # the flood is queued (up to its cap) before the quiet tenant asks
    quiet = [asyncio.create_task(remember("quiet", i)) for i in range(2)]
    await asyncio.sleep(0)
    assert embedder.queued("flood") == (0, 8) and embedder.queued("quiet") == (0, 2)
    gate.set()
    results = await asyncio.wait_for(asyncio.gather(*flood, *quiet, return_exceptions=True), HANG_GUARD_S)
    shed = [r for r in results if isinstance(r, EmbeddingShed)]
    assert len(shed) == 22 and all(r is None for r in results if not isinstance(r, EmbeddingShed))
    # The quiet tenant's embeddings were served in the first turns, not after the flood's eight.
    assert done[:4] == ["flood0", "quiet0", "flood1", "quiet1"], done
    assert len(done) == 10 and embedder.shed == {"flood": 22}
    assert (
        metrics.registry.get_sample_value("prefixgate_near_miss_embeddings_shed_total", {"tenant": "flood"})
        == 22
    )
    assert (
        metrics.registry.get_sample_value("prefixgate_near_miss_embeddings_shed_total", {"tenant": "quiet"})
        is None
    )
    embedder.close()


async def test_urgent_embeddings_never_wait_for_background_ones(embedding_cache):  # noqa: F811
    embedder = PromptEmbedder(cache_dir=embedding_cache)
    await embedder.warm_up()
    gate = hold_background(embedder)  # a background embedding is running and more are queued
    queued = [
        asyncio.create_task(embedder.embed(f"background head {i}", urgent=False, tenant="flood"))
        for i in range(6)
    ]
    await asyncio.sleep(0)
    vector = await asyncio.wait_for(
        embedder.embed("a request waits on this head", tenant="quiet"), HANG_GUARD_S
    )
    assert abs(float(np.linalg.norm(vector)) - 1) < 1e-4
    assert all(not task.done() for task in queued) and embedder.queued() == (0, 6)
    gate.set()
    await asyncio.wait_for(asyncio.gather(*queued), HANG_GUARD_S)
    embedder.close()


async def test_an_urgent_embedding_overtakes_a_queued_background_one_of_the_same_head(embedding_cache):  # noqa: F811
    embedder = PromptEmbedder(cache_dir=embedding_cache)
    await embedder.warm_up()
    gate = hold_background(embedder)
    head = "the same prompt head, remembered then routed"
    remembered = asyncio.create_task(embedder.embed(head, urgent=False, tenant="a"))
    await asyncio.sleep(0)
    routed = await asyncio.wait_for(embedder.embed(head, urgent=True, tenant="a"), HANG_GUARD_S)
    assert not remembered.done()
    gate.set()
    assert np.array_equal(await asyncio.wait_for(remembered, HANG_GUARD_S), routed)  # served from the LRU
    embedder.close()


async def test_a_closed_embedder_sheds_background_work(embedding_cache):  # noqa: F811
    embedder = PromptEmbedder(cache_dir=embedding_cache)
    embedder.close()
    with pytest.raises(EmbeddingShed):
        await embedder.embed("after close", urgent=False, tenant="a")


async def test_another_tenants_head_is_never_a_cache_hit_or_an_in_flight_join(embedding_cache):  # noqa: F811
    """The LRU and the in-flight table were keyed by the text alone: a tenant's request waiting for its
    head's embedding was faster when another tenant had sent the same head (a timing side channel)."""
    embedder = PromptEmbedder(cache_dir=embedding_cache)
    try:
        head = "You are the support assistant of a company whose name only this tenant knows."
        mine = await asyncio.wait_for(embedder.embed(head, tenant="tn_a"), HANG_GUARD_S)
        assert embedder.cached(head, tenant="tn_a") is not None
        assert embedder.cached(head, tenant="tn_b") is None and embedder.cached(head) is None
        release = hold_background(embedder)
        queued = asyncio.ensure_future(embedder.embed(head + " v2", urgent=False, tenant="tn_a"))
        await asyncio.sleep(0)
        theirs = await asyncio.wait_for(embedder.embed(head + " v2", tenant="tn_b"), HANG_GUARD_S)
        assert not queued.done()  # tn_b computed its own, it did not join tn_a's queued job
        release.set()
        await asyncio.wait_for(queued, HANG_GUARD_S)
        assert np.allclose(await embedder.embed(head, tenant="tn_b"), mine) and theirs is not None
    finally:
        embedder.close()


async def test_heads_that_differ_only_past_the_word_pieces_read_are_embedded_once_per_tenant(embedding_cache):  # noqa: F811
    """The model reads the first ``max_seq_tokens`` word pieces of a head: heads that differ only after
    them (a near duplicate whose per-request span comes later) have the same embedding, so the LRU
    serves them without running the model again; keyed per tenant, like every cache entry."""
    embedder = PromptEmbedder(cache_dir=embedding_cache, max_seq_tokens=16)
    try:
        opening = "You are the billing assistant of Acme Corp and you answer in JSON with the totals"
        first = await asyncio.wait_for(embedder.embed(f"{opening}. Ticket 7f3a.", tenant="a"), HANG_GUARD_S)
        assert embedder.model_runs == 1
        second = await asyncio.wait_for(embedder.embed(f"{opening}. Ticket 91bc.", tenant="a"), HANG_GUARD_S)
        assert embedder.model_runs == 1 and np.array_equal(first, second)
        await asyncio.wait_for(embedder.embed(f"{opening}. Ticket 91bc.", tenant="b"), HANG_GUARD_S)
        assert embedder.model_runs == 2  # another tenant's head is never a cache hit
        await asyncio.wait_for(embedder.embed(f"Ticket 91bc. {opening}.", tenant="a"), HANG_GUARD_S)
        assert embedder.model_runs == 3  # a difference inside the pieces read is computed
    finally:
        embedder.close()
