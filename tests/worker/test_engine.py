"""End-to-end engine behaviour: prefix reuse never changes greedy output; namespaces never share."""

import asyncio

import pytest

from tests.worker.conftest import greedy, prompt_of, run, segments
from worker.engine import RequestError
from worker.sequence import SamplingParams


@pytest.mark.parametrize("shared_len", [32, 37, 64, 79])  # on and off block boundaries
async def test_cached_prefix_gives_identical_greedy_output(make_engine, shared_len):
    engine = make_engine()
    context = prompt_of(1, shared_len)
    first = context + prompt_of(2, 11)
    second = context + prompt_of(3, 9)
    await run(engine, "warm", first)
    expected, cold_usage, _ = await run(engine, "cold", second, use_cache=False)
    got, usage, _ = await run(engine, "hot", second)
    assert got == expected
    assert cold_usage["cached_tokens"] == 0
    assert usage["cached_tokens"] == (shared_len // 16) * 16
    assert usage["cached_tokens_by_source"]["l1"] == usage["cached_tokens"]
    assert usage["recomputed_tokens"] == len(second) - usage["cached_tokens"]


async def test_identical_prompt_reuses_all_but_the_last_block(make_engine):
    engine = make_engine()
    prompt = prompt_of(4, 64)
    expected, _, _ = await run(engine, "a", prompt)
    got, usage, _ = await run(engine, "b", prompt)
    assert got == expected
    assert usage["cached_tokens"] == 48  # one token must be computed: the whole last block is


async def test_concurrent_requests_match_sequential_uncached_runs(make_engine):
    engine = make_engine()
    context = prompt_of(5, 40)
    prompts = [context + prompt_of(10 + i, 5 + 3 * i) for i in range(8)]
    expected = [(await run(engine, f"ref{i}", p, use_cache=False))[0] for i, p in enumerate(prompts)]
    results = await asyncio.gather(
        *(run(engine, f"c{i}", p, params=greedy(20)) for i, p in enumerate(prompts))
    )
    assert [r[0][:12] for r in results] == expected
    assert sum(r[1]["cached_tokens"] for r in results) > 0


async def test_output_is_identical_after_eviction_and_preemption(make_engine):
    engine = make_engine(num_blocks=24)
    prompts = [prompt_of(20 + i, 70) for i in range(6)]
    expected = [
        (await run(engine, f"ref{i}", p, params=greedy(60), use_cache=False))[0]
        for i, p in enumerate(prompts)
    ]
    results = await asyncio.gather(
        *(run(engine, f"p{i}", p, params=greedy(60)) for i, p in enumerate(prompts))
    )
    assert [r[0] for r in results] == expected
    stats = engine.stats()
    assert stats["evictions_total"] > 0
    assert stats["preemptions_total"] > 0
    again, _, _ = await run(engine, "again", prompts[-1], params=greedy(60))
    assert again == expected[-1]
    assert engine.stats()["num_blocks_in_use"] == 0


async def test_namespaces_never_reuse_each_others_blocks(make_engine):
    engine = make_engine()
    prompt = prompt_of(30, 80)
    a = segments(b"key-of-tenant-a!" * 2, "a")
    b = segments(b"key-of-tenant-b!" * 2, "b")
    await run(engine, "a1", prompt, segs=a)
    out_b, usage_b, _ = await run(engine, "b1", prompt, segs=b)
    assert usage_b["cached_tokens"] == 0
    out_a, usage_a, _ = await run(engine, "a2", prompt, segs=a)
    assert usage_a["cached_tokens"] == 64
    assert out_a == out_b  # same model, same prompt: only the cache differs
    assert engine.block_manager.purge("a") > 0
    _, usage_a3, _ = await run(engine, "a3", prompt, segs=a)
    assert usage_a3["cached_tokens"] == 0


async def test_cancelled_request_frees_its_blocks_at_once(make_engine):
    engine = make_engine()
    stream = engine.generate("long", prompt_of(40, 50), greedy(900), segments())
    await stream.__anext__()
    assert engine.stats()["num_running"] == 1
    await stream.aclose()
    for _ in range(100):
        await asyncio.sleep(0.01)
        if engine.stats()["num_running"] == 0:
            break
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["num_blocks_in_use"] == 0
    assert stats["requests_aborted"] == 1


async def test_seeded_sampling_is_reproducible(make_engine):
    engine = make_engine()
    prompt = prompt_of(50, 20)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    first, _, _ = await run(engine, "s1", prompt, params=params)
    # Same seed with a busy batch around it: identical.
    others = [run(engine, f"o{i}", prompt_of(60 + i, 30), params=greedy(16)) for i in range(3)]
    second, *_ = await asyncio.gather(run(engine, "s2", prompt, params=params), *others)
    assert first == second[0]
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True)
    assert (await run(engine, "s3", prompt, params=other_seed))[0] != first


async def test_stop_strings_and_stop_tokens_end_generation(make_engine):
    engine = make_engine()
    prompt = prompt_of(70, 20)
    tokens, _, text = await run(engine, "free", prompt, params=greedy(24))
    stop = text[6:8]
    cut = text.find(stop)
    _, _, stopped = await run(engine, "stop", prompt, params=greedy(24, stop=(stop,)))
    assert stopped == text[:cut]
    stop_token = tokens[5]
    got, usage, _ = await run(engine, "stoptok", prompt, params=greedy(24, stop_token_ids=(stop_token,)))
    assert got == tokens[: tokens.index(stop_token) + 1]
    assert usage["completion_tokens"] == len(got)


async def test_invalid_requests_are_refused(make_engine):
    engine = make_engine(max_model_len=128)
    with pytest.raises(RequestError, match="at least one token"):
        await run(engine, "empty", [])
    with pytest.raises(RequestError, match="context window"):
        await run(engine, "long", prompt_of(1, 120), params=greedy(20))
    with pytest.raises(RequestError, match="token ids"):
        await run(engine, "vocab", [1, 2, 100000])


async def test_bfloat16_engine_serves_and_caches(make_engine):
    engine = make_engine(dtype="bfloat16")
    prompt = prompt_of(80, 40)
    first, _, _ = await run(engine, "a", prompt)
    _, usage, _ = await run(engine, "b", prompt)
    assert len(first) == 12 and usage["cached_tokens"] == 32
    assert (
        engine.runner.kv_cache.dtype.is_floating_point
        and str(engine.runner.kv_cache.dtype) == "torch.bfloat16"
    )
