"""KV-event routing with 3 real worker processes: longest cached prefix wins, namespaces never cross,
and a dead worker leaves the routing index at once."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import AsyncOpenAI

from gateway.app import create_app
from gateway.state import PREFIX_INDEX, WORKER_POOL
from tests.gateway.conftest import create_tenant, make_config
from tests.gateway.test_gateway_e2e import MODEL
from tests.worker_process import worker_process

BLOCK = 16


@pytest.fixture
def three_workers(tmp_path):
    """url -> an ExitStack that stops that worker (a test may stop one early)."""
    args = ("--model", MODEL, "--num-blocks", "256", "--max-model-len", "1024")
    managers = [worker_process(*args, log_path=tmp_path / f"{name}.log") for name in "abc"]
    with contextlib.ExitStack() as outer:
        stacks = [outer.enter_context(contextlib.ExitStack()) for _ in managers]
        with ThreadPoolExecutor(len(managers)) as starter:  # start the three at once
            futures = [starter.submit(manager.__enter__) for manager in managers]
            for stack, manager in zip(stacks, managers, strict=True):
                stack.push(manager)  # registered first: a worker that started is stopped even if one failed
            urls = [future.result() for future in futures]
        yield dict(zip(urls, stacks, strict=True))


async def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached within the time bound"
        await asyncio.sleep(0.02)


def holders(index, n_blocks: int) -> set[str]:
    """Workers whose index holds at least ``n_blocks`` blocks in some namespace."""
    return {url for url, state in index.workers.items() if len(state.blocks) >= n_blocks}


async def complete(sdk: AsyncOpenAI, prompt: list[int]) -> int:
    answer = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    return answer.usage.prompt_tokens_details.cached_tokens


async def test_kv_aware_routing_follows_the_cached_prefix_across_three_workers(
    aiohttp_client, sqlite_url, tmp_path, three_workers
):
    urls = list(three_workers)
    client = await aiohttp_client(create_app(make_config(sqlite_url, tmp_path, worker_urls=tuple(urls))))
    index = client.app[PREFIX_INDEX]
    await wait_until(lambda: set(index.workers) == set(urls))  # every worker's event stream is followed
    sdk_a = AsyncOpenAI(
        base_url=str(client.make_url("/v1")), api_key=(await create_tenant(client))["api_key"], max_retries=0
    )
    sdk_b = AsyncOpenAI(
        base_url=str(client.make_url("/v1")),
        api_key=(await create_tenant(client, name="beta"))["api_key"],
        max_retries=0,
    )
    rng = random.Random(7)
    shared = [rng.randrange(1, 200) for _ in range(3 * BLOCK)]  # 3 shared blocks, then a distinct 4th
    assert await complete(sdk_a, shared + [rng.randrange(1, 200) for _ in range(2 * BLOCK)]) == 0
    await wait_until(lambda: len(holders(index, 5)) == 1)
    (holder,) = holders(index, 5)
    # Follow-ups share only the first 3 blocks: a hash of the first 4 blocks scatters them over the
    # workers, the KV index sends every one to the worker that holds the shared 3.
    for _ in range(6):
        tail = [rng.randrange(1, 200) for _ in range(2 * BLOCK)]
        assert await complete(sdk_a, shared + tail) >= 3 * BLOCK
    # The same tokens from another tenant match nothing: its hash chain starts from another key.
    assert await complete(sdk_b, shared + [1] * (2 * BLOCK)) == 0

    # The holder dies: it leaves the index at once and requests go on to the others.
    three_workers[holder].close()
    await wait_until(lambda: holder not in index.workers, timeout_s=5)
    pool = client.app[WORKER_POOL]
    await wait_until(lambda: not pool.workers[holder].healthy, timeout_s=5)
    assert await complete(sdk_a, shared + [2] * (2 * BLOCK)) == 0  # served by a survivor, cold
    await sdk_a.close()
    await sdk_b.close()
