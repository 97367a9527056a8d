"""When a near-miss request waits for its head's embedding, and for how long.

The wait bound is a deadline from the request's arrival, checked when the wait ends; a head the tenant
already embedded (by its text or its word pieces) needs no wait; with a live KV-event index a request
waits only when FAISS could find what the index cannot see yet.

The embedder and the model are real (the int8 graph, no servers). The loop's timer cannot be trusted under
load: a saturated machine runs it when the loop gets a CPU, and by then the embedding may have come in
too. These tests make that happen on purpose (the loop is held, synchronously, until the embedding is done
and the deadline has passed) instead of waiting for a loaded machine to do it; nothing asserts wall time."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from gateway.embedding import PromptEmbedder
from gateway.metrics import GatewayMetrics
from gateway.near_miss import NearMissRouting
from tests.gateway.test_gateway_model import runtime  # noqa: F401 - fixture
from tests.gateway.test_gateway_near_miss import embedding_cache  # noqa: F401 - fixture
from tests.gateway.test_near_miss_routing_decisions import SEGMENTS, TENANT, URLS, request

HANG_GUARD_S = 60  # only against a hang


def sample(routing: NearMissRouting, name: str, labels: dict | None = None) -> float:
    return routing._metrics.registry.get_sample_value(name, labels or {}) or 0.0


async def searchable_routing(embedding_cache, runtime, max_wait_s: float, **kwargs) -> NearMissRouting:  # noqa: F811
    """A near-miss router whose tenant namespace holds one embedded prompt (so a request searches FAISS)."""
    embedder = PromptEmbedder(cache_dir=embedding_cache)
    await embedder.warm_up()
    routing = NearMissRouting(embedder=embedder, metrics=GatewayMetrics(), max_wait_s=max_wait_s, **kwargs)
    await routing.route(TENANT, runtime, list(range(1, 97)), SEGMENTS, request(), URLS[0])
    deadline = time.monotonic() + HANG_GUARD_S
    while not routing.num_remembered(TENANT.tenant_id) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)  # embedded in the background
    assert routing.num_remembered(TENANT.tenant_id) == 1
    return routing


def unrelated_prompt(seed: int) -> list[int]:
    """Shares no block with the remembered prompt: the latest prompts nominate nothing, FAISS is asked."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(120, 250, size=80)]


async def test_an_embedding_that_comes_in_after_the_deadline_is_not_used(embedding_cache, runtime):  # noqa: F811
    """The loop is held (as a saturated machine holds it) until the request's embedding is computed and its
    deadline has passed: the vector and the bound's timer are then both ready when the loop resumes. The
    request goes without the vector, counted late, and how far past its deadline it ended is observed
    (before this change the timer happened to win here too, since the vector reaches the waiter through
    more loop turns, but nothing told an operator the bound was overrun)."""
    routing = await searchable_routing(embedding_cache, runtime, max_wait_s=0.05)
    embedder = routing.embedder
    try:
        task = asyncio.create_task(
            routing.route(TENANT, runtime, unrelated_prompt(1), SEGMENTS, request(), URLS[2])
        )
        deadline = time.monotonic() + HANG_GUARD_S
        while not embedder._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0)  # until the request has submitted its urgent embedding
        (future, urgent), *_ = embedder._in_flight.values()
        assert urgent
        held_from = time.perf_counter()
        while (not future.done() or time.perf_counter() - held_from < 0.1) and time.monotonic() < deadline:
            time.sleep(0.001)  # the loop is held: no timer, no callback runs
        assert future.done()
        routed = await asyncio.wait_for(task, HANG_GUARD_S)
        assert routed.worker_url == URLS[2] and routed.exact_tokens is None
        assert sample(routing, "prefixgate_near_miss_routes_total", {"outcome": "late"}) == 1
        assert sample(routing, "prefixgate_near_miss_routes_total", {"outcome": "kept"}) == 1  # the setup's
        assert sample(routing, "prefixgate_near_miss_embed_waits_total", {"outcome": "late"}) == 1
        assert sample(routing, "prefixgate_near_miss_wait_overrun_seconds_count") == 1
    finally:
        await routing.close()


async def test_the_bound_counts_from_the_requests_arrival(embedding_cache, runtime):  # noqa: F811
    """A request that arrived longer ago than the bound (a loaded loop, a follower's hold) does not wait
    for an embedding at all; one that arrived just now, with the same bound, waits and gets it."""
    routing = await searchable_routing(embedding_cache, runtime, max_wait_s=30.0)
    try:
        long_ago = time.perf_counter() - 31.0
        routed = await routing.route(
            TENANT, runtime, unrelated_prompt(2), SEGMENTS, request(), URLS[1], arrived_s=long_ago
        )
        assert routed.worker_url == URLS[1]
        assert sample(routing, "prefixgate_near_miss_embed_waits_total", {"outcome": "expired"}) == 1
        assert sample(routing, "prefixgate_near_miss_embed_seconds_count") == 0  # it did not wait
        assert sample(routing, "prefixgate_near_miss_routes_total", {"outcome": "late"}) == 1

        await routing.route(
            TENANT, runtime, unrelated_prompt(3), SEGMENTS, request(), URLS[1], arrived_s=time.perf_counter()
        )
        assert sample(routing, "prefixgate_near_miss_embed_waits_total", {"outcome": "in_time"}) == 1
        assert sample(routing, "prefixgate_near_miss_routes_total", {"outcome": "kept"}) == 2  # + the setup's
    finally:
        await routing.close()


async def test_a_head_whose_word_pieces_were_embedded_is_at_hand_without_a_wait(embedding_cache, runtime):  # noqa: F811
    """A near duplicate whose per-request span comes after the word pieces the model reads has its
    sibling's vector: the request finds it on the loop (no hand-off to the embedding thread, no wait);
    per tenant, like every entry of the LRU."""
    routing = await searchable_routing(embedding_cache, runtime, max_wait_s=30.0)
    embedder = routing.embedder
    try:
        opening = (
            "You are the billing assistant of Acme Corp and you answer in JSON with the totals of every "
            "invoice the customer names, the currency, the due date and whether it was paid in full"
        )
        first = await embedder.embed(f"{opening} ticket 7f3a, and more text.", tenant=TENANT.tenant_id)
        runs = embedder.model_runs
        late = f"{opening} ticket 7f3a, and other words come here."
        assert embedder.max_seq_tokens == 32  # the opening alone is longer than the pieces read
        vector = embedder.at_hand(late, tenant=TENANT.tenant_id)
        assert vector is not None and np.array_equal(vector, first)
        assert embedder.model_runs == runs and embedder.pieces_hits == 1
        assert embedder.cached(late, tenant=TENANT.tenant_id) is not None  # now under its text too
        assert embedder.at_hand(late, tenant="tn_other") is None  # never another tenant's

        # Through the router: two prompts that part at their first token (no block in common, so the
        # latest prompts nominate nothing) but whose heads read the same word pieces (the control
        # characters they start with are dropped by the embedder's normalizer): the second needs no wait.
        text = runtime.encode_prompt(f" {opening} ticket 7f3a and the rest of a long enough prompt.")
        control = [runtime.encode_prompt(c)[-1] for c in ("\x01", "\x02")]
        await routing.route(TENANT, runtime, [control[0], *text], SEGMENTS, request(), URLS[1])
        waits_before = sample(routing, "prefixgate_near_miss_embed_seconds_count")
        await routing.route(TENANT, runtime, [control[1], *text], SEGMENTS, request(), URLS[1])
        assert sample(routing, "prefixgate_near_miss_embed_waits_total", {"outcome": "at_hand"}) >= 1
        assert sample(routing, "prefixgate_near_miss_embed_seconds_count") == waits_before
    finally:
        await routing.close()


async def test_with_a_live_kv_index_only_what_it_cannot_see_is_waited_for(embedding_cache, runtime):  # noqa: F811
    """With the KV-aware router over the KV-event index, the index holds every stored block a FAISS
    nominee could lend: FAISS can add only a prompt still being prefilled that has left the namespace's
    latest prompts. So a request searches (and waits) only while those are full and were all routed
    within the in-flight window. Before, every request the latest prompts did not cover waited for its
    embedding (16-22 ms p50 at load 5-14, bench.near_miss_path) for a search that could not add reuse."""
    routing = await searchable_routing(
        embedding_cache,
        runtime,
        max_wait_s=30.0,
        exact_index_live=True,
        recent_per_namespace=2,
        in_flight_s=60.0,
    )
    try:
        waits = "prefixgate_near_miss_embed_waits_total"
        await routing.route(TENANT, runtime, unrelated_prompt(5), SEGMENTS, request(), URLS[1])
        assert sample(routing, waits, {"outcome": "indexed"}) == 1  # one latest prompt of two: no search
        assert sample(routing, "prefixgate_near_miss_embed_seconds_count") == 0

        # The latest prompts are full and all routed within the window: an older one may still be in
        # flight, unseen by the index and gone from the latest: FAISS is searched.
        await routing.route(TENANT, runtime, unrelated_prompt(6), SEGMENTS, request(), URLS[1])
        assert sample(routing, waits, {"outcome": "in_time"}) == 1

        routing.in_flight_s = 0.0  # every latest prompt is older than the window: no search again
        await routing.route(TENANT, runtime, unrelated_prompt(7), SEGMENTS, request(), URLS[1])
        assert sample(routing, waits, {"outcome": "indexed"}) == 2
        assert sample(routing, "prefixgate_near_miss_embed_seconds_count") == 1
    finally:
        await routing.close()
