"""The gateway's own count of prompt tokens waiting for prefill on each worker (what the KV-aware router
weighs a cold prompt's placement by), with a real worker over HTTP: a request adds its uncached tokens
when it is sent and takes them off at its first token (streamed) or its answer, and a client that goes
away leaves nothing behind."""

from __future__ import annotations

import asyncio
import random

from openai import AsyncOpenAI

from gateway.app import create_app
from gateway.state import PREFIX_INDEX, WORKER_POOL
from tests.gateway.conftest import create_tenant, make_config
from tests.gateway.test_gateway_e2e import MODEL
from tests.gateway.test_gateway_routing_kv import wait_until
from tests.worker_process import worker_process

BLOCK = 16


async def test_pending_prefill_tokens_follow_each_request_until_its_first_token(
    aiohttp_client, sqlite_url, tmp_path
):
    args = ("--model", MODEL, "--num-blocks", "256", "--max-model-len", "1024")
    with worker_process(*args, log_path=tmp_path / "worker.log") as url:
        config = make_config(sqlite_url, tmp_path, worker_urls=(url,))
        client = await aiohttp_client(create_app(config))
        index, pool = client.app[PREFIX_INDEX], client.app[WORKER_POOL]
        await wait_until(lambda: url in index.workers and pool.workers[url].healthy)
        state = pool.workers[url]
        # What the gateway counts pending at the moment it sends each request: read inside the client's
        # calls, so a fast prefill on a loaded machine cannot slip between two polls of the test.
        seen: list[int] = []
        hold = asyncio.Event()
        hold.set()
        generate, generate_stream = state.client.generate, state.client.generate_stream

        async def counted_generate(payload):
            seen.append(state.pending_prefill_tokens)
            await hold.wait()
            return await generate(payload)

        def counted_stream(payload):
            seen.append(state.pending_prefill_tokens)
            return generate_stream(payload)

        state.client.generate, state.client.generate_stream = counted_generate, counted_stream
        sdk = AsyncOpenAI(
            base_url=str(client.make_url("/v1")),
            api_key=(await create_tenant(client))["api_key"],
            max_retries=0,
        )
        rng = random.Random(3)
        prompt = [rng.randrange(1, 200) for _ in range(40 * BLOCK + 5)]

        # Cold, not streamed: the whole prompt is pending until the answer.
        await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        assert seen == [len(prompt)]
        assert (state.in_flight, state.pending_prefill_tokens) == (0, 0)

        # Warm, streamed: only what the index does not show cached there, until the first token.
        await wait_until(lambda: len(index.workers[url].blocks) >= 40)
        chunks = await sdk.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        assert seen[1:] == [5]
        async for _ in chunks:
            assert state.pending_prefill_tokens == 0  # the gateway took it off before passing the token on
        assert (state.in_flight, state.pending_prefill_tokens) == (0, 0)

        # A client that goes away before its first token (held before the worker is called) leaves nothing.
        hold.clear()
        other = [rng.randrange(1, 200) for _ in range(50 * BLOCK)]
        gone = asyncio.ensure_future(sdk.completions.create(model=MODEL, prompt=other, max_tokens=1))
        await wait_until(lambda: len(seen) == 3, timeout_s=30)
        assert seen[2] == state.pending_prefill_tokens == len(other)
        gone.cancel()
        await wait_until(lambda: (state.in_flight, state.pending_prefill_tokens) == (0, 0), timeout_s=30)
        hold.set()
        await sdk.close()
