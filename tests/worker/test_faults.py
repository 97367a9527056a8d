"""Fault and overload scenarios of issue 9 against real worker processes: nothing hangs, nothing leaks."""

import asyncio
import json

import aiohttp
import pytest

from tests.worker_process import worker_process

KEY = "00112233445566778899aabbccddeeff"


def body(rid: str, prompt: list[int], *, max_tokens: int = 4, cache: bool = True, **sampling) -> dict:
    return {
        "request_id": rid,
        "prompt_token_ids": prompt,
        "namespace": [{"start_token": 0, "namespace_id": "t-a", "key": KEY}],
        "sampling": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **sampling},
        "cache": cache,
    }


async def generate(s: aiohttp.ClientSession, url: str, payload: dict) -> tuple[int, dict]:
    async with s.post(f"{url}/v1/generate", data=json.dumps(payload)) as r:
        return r.status, await r.json()


async def stats(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(f"{url}/v1/stats") as r:
        return await r.json()


async def test_issue_repro_shared_prefix_then_a_large_request_completes_without_leaking(tmp_path):
    args = ["--model", "random-tiny", "--num-blocks", "128", "--max-num-batched-tokens", "4096"]
    with worker_process(*args, "--l2-bytes", "0", log_path=tmp_path / "worker.log") as url:
        prefix = [(i * 31) % 251 for i in range(40 * 16)]
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            for attempt in range(3):  # A and B must be admitted in the same step: a busy step gathers them
                busy = asyncio.create_task(generate(s, url, body(f"w{attempt}", [5] * 1900, cache=False)))
                await asyncio.sleep(0.01)
                a = asyncio.create_task(generate(s, url, body(f"A{attempt}", prefix + [1] * 8, max_tokens=12)))
                b = asyncio.create_task(generate(s, url, body(f"B{attempt}", prefix + [2] * 8, max_tokens=300)))
                status_a, out_a = await a
                assert status_a == 200, out_a
                c = generate(s, url, body(f"C{attempt}", [(i * 7) % 251 for i in range(70 * 16)]))
                (status_b, out_b), (status_c, out_c), (status_w, _) = await asyncio.gather(b, c, busy)
                assert (status_b, status_c, status_w) == (200, 200, 200), (out_b, out_c)
                if out_b["usage"]["cached_tokens"] == 0:  # B prefilled the prefix next to A: the repro
                    break
            final = await stats(s, url)
    assert final["num_running"] == 0 and final["num_waiting"] == 0
    assert final["num_blocks_in_use"] == 0, final
