"""Fault and overload scenarios of issue 9 against real worker processes: nothing hangs, nothing leaks."""

import asyncio
import json

import aiohttp
import orjson
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
    # The issue's repro, with the context window the 128-block pool can hold (the worker refuses more).
    args = ["--model", "random-tiny", "--num-blocks", "128", "--max-model-len", "2032"]
    args += ["--max-num-batched-tokens", "4096"]
    with worker_process(*args, "--l2-bytes", "0", log_path=tmp_path / "worker.log") as url:
        prefix = [(i * 31) % 251 for i in range(40 * 16)]
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            for attempt in range(3):  # A and B must be admitted in the same step: a busy step gathers them
                busy = asyncio.create_task(generate(s, url, body(f"w{attempt}", [5] * 1900, cache=False)))
                await asyncio.sleep(0.01)
                a = asyncio.create_task(
                    generate(s, url, body(f"A{attempt}", prefix + [1] * 8, max_tokens=12))
                )
                b = asyncio.create_task(
                    generate(s, url, body(f"B{attempt}", prefix + [2] * 8, max_tokens=300))
                )
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


@pytest.fixture(scope="module")
def small_worker(tmp_path_factory):
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    args = ["--model", "random-tiny", "--num-blocks", "256", "--max-model-len", "2048", "--max-num-seqs", "2"]
    with worker_process(*args, "--max-waiting-requests", "2", "--l2-bytes", "0", log_path=log) as url:
        yield url


async def test_overload_is_answered_503_with_retry_after_fast(small_worker):
    async def one(s, i):
        payload = body(f"o{i}", [(i * 13 + k) % 251 for k in range(300)], max_tokens=40)
        if i % 2:
            async with s.post(f"{small_worker}/v1/generate", json={**payload, "stream": True}) as r:
                return r.status, dict(r.headers), await r.read()
        async with s.post(f"{small_worker}/v1/generate", json=payload) as r:
            return r.status, dict(r.headers), await r.read()

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        results = await asyncio.gather(*(one(s, i) for i in range(16)))
        after = await stats(s, small_worker)
    shed = [(h, json.loads(b)) for status, h, b in results if status == 503]
    served = [status for status, _, _ in results if status == 200]
    assert shed and len(served) >= 2 and len(shed) + len(served) == 16
    for headers, err in shed:
        assert 1 <= int(headers["Retry-After"]) <= 30
        assert err["error"]["code"] == "worker_overloaded" and err["error"]["type"] == "server_error"
    assert after["num_queued"] == 0 and after["requests_rejected_overloaded"] == len(shed)


async def test_hostile_sampling_over_http_fails_nobody(small_worker):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        (sg, good), (sb, bad) = await asyncio.gather(
            generate(s, small_worker, body("h-good", list(range(50)), max_tokens=10)),
            generate(
                s,
                small_worker,
                body("h-bad", list(range(60)), max_tokens=10, temperature=1e-40, top_p=1e-300),
            ),
        )
    assert (sg, sb) == (200, 200), (good, bad)
    assert len(good["token_ids"]) == len(bad["token_ids"]) == 10


@pytest.mark.parametrize(
    ("sampling", "param"),
    [
        (b'{"temperature": NaN}', "temperature"),
        (b'{"top_p": Infinity}', "top_p"),
        (b'{"seed": 18446744073709551616}', "seed"),
        (b'{"top_k": -1}', "top_k"),
        (b'{"max_tokens": 0}', "max_tokens"),
    ],
)
async def test_out_of_range_sampling_values_are_a_400(small_worker, sampling, param):
    raw = json.dumps(body("v", [1, 2, 3])).replace(
        '"sampling": {', '"sampling": ' + sampling.decode() + ', "x": {'
    )
    async with aiohttp.ClientSession() as s, s.post(f"{small_worker}/v1/generate", data=raw) as r:
        assert r.status == 400
        err = await r.json()
    assert err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error"


async def test_health_and_latency_histograms(small_worker):
    async with aiohttp.ClientSession() as s:
        await generate(s, small_worker, body("m1", list(range(20))))
        async with s.get(f"{small_worker}/healthz") as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"
        async with s.get(f"{small_worker}/metrics") as r:
            text = await r.text()
        async with s.get(f"{small_worker}/v1/stats") as r:
            stats_body = orjson.loads(await r.read())  # strict JSON (no Infinity), as the gateway parses it
    assert stats_body["histograms"]["ttft_seconds"]["buckets"][-1][0] == "+Inf"
    assert 'prefixgate_worker_ttft_seconds_bucket{le="+Inf"}' in text
    assert "prefixgate_worker_queue_time_seconds_count" in text
    assert "prefixgate_worker_requests_rejected_overloaded_total" in text
