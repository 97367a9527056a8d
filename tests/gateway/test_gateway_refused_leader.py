"""A request that never gets its prefix computed leaves no cold placement behind for others to wait on.

The KV-aware router remembers where it placed a cold prefix, and a later request with the same head
block (a *follower*: another `shared` tenant, or one behind a promoted prefix) waits up to
``leader_hold_s`` (2 s) for the leader's prefill there. A leader refused for tokens per minute, or by
the worker, or cancelled, computes nothing: its follower waited the whole hold (0.04 s -> 2.0 s).

The worker's refusal was shown with ``top_p: 0``, which the worker refused after the gateway had
routed it; since review r6 #6 it is served (as the smallest nucleus), and no request that passes the
gateway's checks is refused by the bundled worker any more. Any answer but a 200 drops the placement
(``tenant_calls.record_call`` → ``RequestPipeline.abandon``); the router's side of that is tested above
without a worker."""

from __future__ import annotations

import asyncio
import random
import time

import openai
import pytest
from openai import AsyncOpenAI

from gateway.app import create_app
from gateway.kv_index import PrefixIndex
from gateway.routing import KVAwareRouter, RouteRequest, WorkerLoad
from gateway.state import PREFIX_INDEX
from tests.gateway.conftest import create_tenant, make_config
from tests.gateway.test_gateway_e2e import MODEL
from tests.gateway.test_gateway_routing_kv import wait_until

BLOCK = 16
URLS = ("http://w1", "http://w2", "http://w3")


def held_router():
    """A KV-aware router with a 2 s leader hold on a settable clock (``now[0]``), and the request of a
    given id for one head block on three calm workers: (router, now, request)."""
    now = [100.0]
    router = KVAwareRouter(clock=lambda: now[0], leader_hold_s=2.0)
    calm = [WorkerLoad(url=u, in_flight=0) for u in URLS]

    def request(request_id: str) -> RouteRequest:
        return RouteRequest(
            affinity_key=b"k" * 16,
            candidates=calm,
            num_prompt_tokens=160,
            head_block=b"h" * 32,
            request_id=request_id,
        )

    return router, now, request


def test_a_dropped_placement_holds_no_follower_and_only_its_own_request_drops_it():
    router, now, request = held_router()
    leader, _ = router.choose_and_hold(request("leader"))
    now[0] += 0.5
    assert router.choose_and_hold(request("follower")) == (leader, 1.5)
    assert router.drop_placement(request("follower")) is None  # a follower's failure leaves the leader's
    assert router.drop_placement(request("")) is None  # nor does a request without an id
    assert router.choose_and_hold(request("follower-2")) == (leader, 1.5)
    assert router.drop_placement(request("leader")) == leader  # refused: nothing will be computed there
    url, hold = router.choose_and_hold(request("next"))
    assert hold == 0.0  # the next request is a leader itself
    assert router.drop_placement(request("leader")) is None  # gone already; "next" owns the placement now
    assert router.choose_and_hold(request("after")) == (url, 2.0)  # follows "next", placed just now
    assert url == leader  # the same rendezvous choice


async def test_followers_waiting_for_a_dropped_leader_are_released_at_once():
    index = PrefixIndex()
    block = b"h" * 32
    waiting = asyncio.ensure_future(index.wait_stored(URLS[0], block, 30.0))
    elsewhere = asyncio.ensure_future(index.wait_stored(URLS[1], block, 30.0))
    await asyncio.sleep(0)
    index.release(URLS[0], block)
    assert await asyncio.wait_for(waiting, 5) is False  # not stored: the follower computes it itself
    assert not elsewhere.done()  # another worker's waiters are not its to release
    elsewhere.cancel()


async def test_a_dropped_leader_releases_only_its_own_followers():
    """Two leaders placed the same head block on one worker: tenant A's prompt under its
    ``prompt_cache_key`` and tenant B's (``shared`` tenants hash a common prompt alike; another cache key
    is another placement). B's follower waits for B's prefill. Before, A's refusal released every waiter
    of that (worker, block): B's follower went at once and computed the prefix a second time beside B's
    leader. Now it keeps waiting for B, and is released by B's own refusal or the block's arrival."""
    import aiohttp

    from gateway.pipeline import RequestPipeline
    from gateway.workers import WorkerPool

    router = KVAwareRouter(leader_hold_s=30.0)
    index = PrefixIndex()
    session = aiohttp.ClientSession()
    pipeline = RequestPipeline(
        pool=WorkerPool(URLS[:1], session),
        router=router,
        salt=b"salt",
        default_max_tokens=16,
        affinity_blocks=4,
        prefix_index=index,
    )
    calm = [WorkerLoad(url=URLS[0], in_flight=0)]

    def request(affinity: bytes, request_id: str) -> RouteRequest:
        return RouteRequest(
            affinity_key=affinity,
            candidates=calm,
            num_prompt_tokens=160,
            head_block=b"h" * 32,
            request_id=request_id,
        )

    a_leader, b_leader = request(b"a" * 16, "a-leader"), request(b"b" * 16, "b-leader")
    assert await pipeline.choose_worker(a_leader) == URLS[0]  # cold: placed, no wait
    assert await pipeline.choose_worker(b_leader) == URLS[0]
    a_follower = asyncio.ensure_future(pipeline.choose_worker(request(b"a" * 16, "a-follower")))
    b_follower = asyncio.ensure_future(pipeline.choose_worker(request(b"b" * 16, "b-follower")))
    await asyncio.sleep(0.05)
    assert not a_follower.done() and not b_follower.done()  # both wait for their leader's prefill
    pipeline.abandon(a_leader)  # A refused (tokens per minute, the worker's 4xx) or failed
    assert await asyncio.wait_for(a_follower, 5) == URLS[0]  # its own follower goes at once
    await asyncio.sleep(0.05)
    assert not b_follower.done()  # B's leader is still computing the head there
    pipeline.abandon(b_leader)
    assert await asyncio.wait_for(b_follower, 5) == URLS[0]
    await session.close()


async def _victim_latency(sdk: AsyncOpenAI, prompt: list[int]) -> float:
    started = time.perf_counter()
    await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    return time.perf_counter() - started


async def test_a_refused_request_never_makes_another_tenant_wait(
    aiohttp_client, sqlite_url, tmp_path, worker_url
):
    client = await aiohttp_client(create_app(make_config(sqlite_url, tmp_path, worker_urls=(worker_url,))))
    index = client.app[PREFIX_INDEX]
    await wait_until(lambda: set(index.workers) == {worker_url})  # the KV-event index follows the worker
    base = str(client.make_url("/v1"))
    mallory = await create_tenant(client, name="mallory", isolation="shared", rate_limit_tpm=10)
    victim = await create_tenant(client, name="victim", isolation="shared")
    sdk_m = AsyncOpenAI(base_url=base, api_key=mallory["api_key"], max_retries=0)
    sdk_v = AsyncOpenAI(base_url=base, api_key=victim["api_key"], max_retries=0)
    rng = random.Random("tokens_per_minute")  # its own prompts: the worker (one per session) keeps its cache
    await _victim_latency(sdk_v, [rng.randrange(1, 200) for _ in range(6 * BLOCK)])  # warm up
    # Side by side: the victim's cold prompt with nobody before it, then one mallory was refused for.
    baseline = await _victim_latency(sdk_v, [rng.randrange(1, 200) for _ in range(6 * BLOCK)])
    prompt = [rng.randrange(1, 200) for _ in range(6 * BLOCK)]  # e.g. a public prompt both send
    with pytest.raises(openai.RateLimitError):
        await sdk_m.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    after_refusal = await _victim_latency(sdk_v, prompt)
    await sdk_m.close()
    await sdk_v.close()
    # The hold is 2 s: waiting it out shows as + 2 s over the baseline, whatever the machine's load.
    print(f"victim latency {baseline:.3f} s alone, {after_refusal:.3f} s after mallory's refusal")
    assert after_refusal < baseline + 1.0, (baseline, after_refusal)
