"""The worker's HTTP API, against a real worker process."""

import asyncio
import json

import aiohttp
import pytest
from tokenizers import Tokenizer

from tests.worker_process import worker_process

KEY = "00112233445566778899aabbccddeeff"


@pytest.fixture(scope="module")
def worker_url(tmp_path_factory):
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    with worker_process(
        "--model", "random-tiny", "--num-blocks", "256", "--max-model-len", "1024", log_path=log
    ) as url:
        yield url


def body(rid: str, prompt: list[int], **extra) -> dict:
    return {
        "request_id": rid,
        "prompt_token_ids": prompt,
        "namespace": [{"start_token": 0, "namespace_id": "t-a", "key": KEY}],
        "sampling": {"max_tokens": 8, "temperature": 0, "ignore_eos": True},
        **extra,
    }


async def post(session: aiohttp.ClientSession, url: str, payload) -> tuple[int, dict]:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    async with session.post(url, data=data) as response:
        return response.status, await response.json()


async def test_info_gives_what_the_gateway_needs(worker_url):
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{worker_url}/v1/info") as r:
            info = await r.json()
        tok = Tokenizer.from_str(info["tokenizer_json"])
        status, encoded = await post(s, f"{worker_url}/v1/tokenize", {"text": "héllo <|end|>"})
    assert status == 200
    assert tok.encode("héllo <|end|>", add_special_tokens=False).ids == encoded["token_ids"]
    assert info["block_size"] == 16 and info["max_model_len"] == 1024
    assert len(bytes.fromhex(info["model_fingerprint"])) == 32
    assert "messages" in info["chat_template"] and info["eos_token_ids"]


async def test_generate_stream_and_non_stream_agree_and_report_usage(worker_url):
    prompt = list(range(40))
    async with aiohttp.ClientSession() as s:
        status, first = await post(s, f"{worker_url}/v1/generate", body("g1", prompt))
        assert status == 200
        async with s.post(f"{worker_url}/v1/generate", json=body("g2", prompt, stream=True)) as r:
            assert r.headers["Content-Type"].startswith("application/x-ndjson")
            lines = [json.loads(line) async for line in r.content if line.strip()]
    assert [ln["type"] for ln in lines] == ["delta"] * 7 + ["final"]
    streamed = [t for ln in lines for t in ln["token_ids"]]
    assert streamed == first["token_ids"] and len(streamed) == 8
    assert first["usage"]["cached_tokens"] == 0
    usage = lines[-1]["usage"]
    assert usage["cached_tokens"] == 32 and usage["prompt_tokens"] == 40 and usage["completion_tokens"] == 8
    assert usage["prefill_ms"] >= 0 and usage["estimated_saved_prefill_ms"] > 0


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"{not json", "malformed JSON"),
        (b"[1, 2]", "JSON object"),
        ({"request_id": "x", "prompt_token_ids": "abc"}, "prompt_token_ids"),
        ({"request_id": "x", "prompt_token_ids": [1, 2]}, "namespace"),
        (
            body("x", [1, 2], namespace=[{"start_token": 8, "namespace_id": "a", "key": KEY}]),
            "start at token 0",
        ),
        (body("x", [1, 2], namespace=[{"start_token": 0, "namespace_id": "a", "key": "zz"}]), "hex"),
        (body("x", [1, 2], sampling={"temperature": "hot"}), "temperature"),
        (body("x", [1, 2], sampling={"top_p": 0}), "top_p"),
        (body("x", [7] * 1000, sampling={"max_tokens": 100}), "context window"),
        (body("x", []), "at least one token"),
        (
            body("x", [1, 2], namespace=[{"start_token": 0, "namespace_id": "x" * 300, "key": KEY}]),
            "namespace_id",
        ),
        (
            body("x", [1, 2], namespace=[{"start_token": 0, "namespace_id": "t-*", "key": KEY}]),
            "namespace_id",
        ),
        (
            body("x", [1, 2], namespace=[{"start_token": 0, "namespace_id": "a:b", "key": KEY}]),
            "namespace_id",
        ),
        (body("x", [1, 2], namespace=[{"start_token": 0, "namespace_id": "..", "key": KEY}]), "namespace_id"),
        (body("x", [1, 2], owner="a:b"), "'owner'"),
        (body("x", [1, 2], owner=7), "'owner'"),
        # isdigit() but not int(): superscript two, circled one (were a 500)
        (body("x", [1, 2], sampling={"logit_bias": {"\u00b2": 1}}), "logit_bias"),
        (body("x", [1, 2], sampling={"logit_bias": {"\u2460": 1}}), "logit_bias"),
        # integers too large for a float (OverflowError, were a 500)
        (body("x", [1, 2], sampling={"temperature": 10**400}), "temperature"),
        (body("x", [1, 2], sampling={"top_p": 10**400}), "top_p"),
        (body("x", [1, 2], sampling={"presence_penalty": 10**400}), "presence_penalty"),
        (body("x", [1, 2], sampling={"frequency_penalty": -(10**400)}), "frequency_penalty"),
    ],
)
async def test_bad_input_gets_an_openai_style_400(worker_url, payload, message):
    async with aiohttp.ClientSession() as s:
        status, err = await post(s, f"{worker_url}/v1/generate", payload)
    assert status == 400
    assert message in err["error"]["message"]
    assert err["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1/generate", "/v1/abort", "/v1/purge", "/v1/tokenize", "/v1/detokenize"])
async def test_deeply_nested_json_is_a_400_not_a_500(worker_url, path):
    deep = b"[" * 100_000 + b"]" * 100_000  # json.loads raises RecursionError, not JSONDecodeError
    async with aiohttp.ClientSession() as s:
        status, err = await post(s, f"{worker_url}{path}", deep)
    assert status == 400
    assert err["error"]["code"] == "invalid_json" and "nested" in err["error"]["message"]


async def test_unknown_route_is_a_json_404(worker_url):
    async with aiohttp.ClientSession() as s, s.get(f"{worker_url}/v1/nope") as r:
        assert r.status == 404
        assert "error" in await r.json()


async def test_client_disconnect_mid_stream_cancels_the_request(worker_url):
    async with aiohttp.ClientSession() as s:
        payload = body(
            "gone",
            list(range(30)),
            stream=True,
            sampling={"max_tokens": 900, "temperature": 0, "ignore_eos": True},
        )
        async with s.post(f"{worker_url}/v1/generate", json=payload) as r:
            await r.content.readline()
        # Leaving the block closed the connection mid-stream.
        for _ in range(200):
            async with s.get(f"{worker_url}/v1/stats") as r:
                stats = await r.json()
            if stats["num_running"] == 0:
                break
            await asyncio.sleep(0.02)
    assert stats["num_running"] == 0 and stats["num_blocks_in_use"] == 0
    assert stats["requests_aborted"] >= 1


async def test_purge_erases_a_namespace(worker_url):
    prompt = list(range(100, 150))
    async with aiohttp.ClientSession() as s:
        await post(s, f"{worker_url}/v1/generate", body("p1", prompt))
        status, purged = await post(s, f"{worker_url}/v1/purge", {"namespace_id": "t-a"})
        assert status == 200 and purged["blocks_erased"]["l1"] >= 3
        _, again = await post(s, f"{worker_url}/v1/generate", body("p2", prompt))
    assert again["usage"]["cached_tokens"] == 0


@pytest.mark.parametrize("namespace_id", ["*", "~quota", "t-[ab]", "x" * 300, "a:b", "", 5])
async def test_purge_refuses_a_malformed_namespace_id(worker_url, namespace_id):
    async with aiohttp.ClientSession() as s:
        status, err = await post(s, f"{worker_url}/v1/purge", {"namespace_id": namespace_id})
    assert status == 400 and err["error"]["param"] == "namespace_id"


async def test_metrics_are_prometheus_text(worker_url):
    async with aiohttp.ClientSession() as s, s.get(f"{worker_url}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    assert "prefixgate_worker_requests_total" in text
    assert 'prefixgate_worker_tier_hit_blocks_total{tier="l1"}' in text
    assert "prefixgate_worker_num_blocks_total 256.0" in text
