"""A follower goes at its leader's first token, not when the KV event reaches the gateway.

A request whose cold prefix was just placed by another (its *leader*) waits for the leader's prefill
(``KVAwareRouter.choose_and_hold``). It used to wait until the worker's KV event announced the head
block: the event comes through the worker's long-poll (20 ms granularity) and the gateway's index, so
every follower waited that lag on top of its leader's prefill (``python -m bench.routing_opening``: at
100 ms of lag the opening's second slowest request was slower than least-loaded's in 10 of 20 seeds,
2 of 20 when followers go at the leader's first token). The gateway sees that first token itself: the
worker streams it after the step that computed (and published) the prompt's blocks."""

from __future__ import annotations

import random
import time

import pytest
from openai import AsyncOpenAI

from gateway.app import create_app
from gateway.state import KV_CONSUMER, PREFIX_INDEX
from tests.gateway.conftest import create_tenant, make_config
from tests.gateway.test_gateway_e2e import MODEL
from tests.gateway.test_gateway_routing_kv import wait_until

BLOCK = 16


async def _timed(sdk: AsyncOpenAI, prompt: list[int], stream: bool) -> tuple[float, int]:
    """(seconds to the answer, cached prompt tokens)."""
    started = time.perf_counter()
    if stream:
        chunks = await sdk.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=1,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        cached = 0
        async for chunk in chunks:
            if chunk.usage is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens
        return time.perf_counter() - started, cached
    answer = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    return time.perf_counter() - started, answer.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("stream", [False, True])
async def test_a_follower_does_not_wait_for_the_kv_event_after_its_leader_s_first_token(
    aiohttp_client, sqlite_url, tmp_path, worker_url, stream
):
    client = await aiohttp_client(create_app(make_config(sqlite_url, tmp_path, worker_urls=(worker_url,))))
    index = client.app[PREFIX_INDEX]
    await wait_until(lambda: set(index.workers) == {worker_url})
    # The KV events stop reaching the index (a lag as long as the test lasts): the index still knows the
    # worker, so requests are routed by it, but it never learns what the next prompts store.
    await client.app[KV_CONSUMER].close()
    base = str(client.make_url("/v1"))
    leader = await create_tenant(client, name="leader", isolation="shared")  # one namespace: one head
    follower = await create_tenant(client, name="follower", isolation="shared")
    sdk_l = AsyncOpenAI(base_url=base, api_key=leader["api_key"], max_retries=0)
    sdk_f = AsyncOpenAI(base_url=base, api_key=follower["api_key"], max_retries=0)
    rng = random.Random(f"follower-{stream}")  # the session's worker keeps its cache: fresh prompts
    await _timed(sdk_f, [rng.randrange(1, 200) for _ in range(6 * BLOCK)], stream)  # warm up
    baseline, _ = await _timed(sdk_f, [rng.randrange(1, 200) for _ in range(6 * BLOCK)], stream)
    prompt = [rng.randrange(1, 200) for _ in range(6 * BLOCK)]
    await _timed(sdk_l, prompt, stream)  # the leader: placed cold, prefilled, answered
    after_leader, cached = await _timed(sdk_f, prompt, stream)  # within the leader's 2 s hold
    await sdk_l.close()
    await sdk_f.close()
    print(f"stream={stream}: follower {baseline:.3f} s alone, {after_leader:.3f} s after its leader")
    assert cached >= 4 * BLOCK  # it followed its leader to the worker holding the prefix
    # Waiting for the event that never comes shows as the rest of the 2 s hold, whatever the load.
    assert after_leader < baseline + 1.0, (baseline, after_leader)
