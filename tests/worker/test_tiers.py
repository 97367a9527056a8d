"""The tiered store end to end: L2, L3 (with restart and faults), Redis, namespaces in every tier."""

import shutil
import time

from tests.worker.conftest import greedy, prompt_of, run, segments

BLOCK_BYTES = 8192  # random-tiny: 2 layers x (k, v) x 16 tokens x 2 heads x 16 dims x 4 bytes
A = segments(b"key-of-tenant-a!" * 2, "t-a")
B = segments(b"key-of-tenant-b!" * 2, "t-b")


async def push_out_of_l1(engine, n: int = 6) -> None:
    """Fill the small L1 with unrelated prompts so the earlier blocks are evicted downwards."""
    for i in range(n):
        await run(engine, f"filler-{time.monotonic_ns()}-{i}", prompt_of(900 + i, 80), segs=A)


async def test_prefix_served_from_l2_gives_identical_output(make_engine):
    engine = make_engine(num_blocks=24, l2_bytes=64 * BLOCK_BYTES)
    prompt = prompt_of(1, 80)
    expected, _, _ = await run(engine, "ref", prompt, use_cache=False)
    await run(engine, "first", prompt, segs=A)
    await push_out_of_l1(engine)
    got, usage, _ = await run(engine, "again", prompt, segs=A)
    assert got == expected
    assert usage["cached_tokens_by_source"]["l2"] > 0
    assert usage["cached_tokens"] == 64
    stats = engine.stats()["tiers"]
    assert stats["hits_blocks"]["l2"] >= 1 and stats["l2"]["stored_total"] > 0


async def test_prefix_served_from_l3_none_gives_identical_output(make_engine, tmp_path):
    engine = make_engine(num_blocks=24, l2_bytes=4 * BLOCK_BYTES, l3_dir=tmp_path, l3_min_free_bytes=0)
    prompt = prompt_of(2, 80)
    expected, _, _ = await run(engine, "ref", prompt, use_cache=False)
    await run(engine, "first", prompt, segs=A)
    await push_out_of_l1(engine)
    engine.store.wait_for_writes()
    got, usage, _ = await run(engine, "again", prompt, segs=A)
    assert got == expected
    assert usage["cached_tokens_by_source"]["l3"] > 0
    assert sum(usage["cached_tokens_by_source"].values()) == usage["cached_tokens"] == 64
    assert list(tmp_path.rglob("*.kv"))


async def test_disk_tier_survives_a_restart_and_damaged_files_are_misses(make_engine, tmp_path):
    prompts = [prompt_of(3, 80), prompt_of(4, 80), prompt_of(5, 80)]
    first = make_engine(l3_dir=tmp_path, l3_min_free_bytes=0)
    expected = [(await run(first, f"ref{i}", p, use_cache=False))[0] for i, p in enumerate(prompts)]
    for i, p in enumerate(prompts):
        await run(first, f"fill{i}", p, segs=A)
    first.stop()  # a clean stop flushes L1 and L2 to disk
    files = sorted(tmp_path.rglob("*.kv"))
    assert len(files) == 3
    by_prompt = {}
    for f in files:
        data = f.read_bytes()
        for i, p in enumerate(prompts):
            if str(p[:16]).replace(" ", "") in data.decode("latin-1"):
                by_prompt[i] = f
    # Prompt 1's file gets a flipped payload byte, prompt 2's is truncated; prompt 0's stays intact.
    damaged = bytearray(by_prompt[1].read_bytes())
    damaged[-5] ^= 0xFF
    by_prompt[1].write_bytes(bytes(damaged))
    by_prompt[2].write_bytes(by_prompt[2].read_bytes()[:-100])

    second = make_engine(l3_dir=tmp_path, l3_min_free_bytes=0)
    disk = second.store.disk
    assert disk.counters["corrupt_deleted_total"] == 1  # the truncated file, found at start-up
    assert not by_prompt[2].exists()
    results = [await run(second, f"after{i}", p, segs=A) for i, p in enumerate(prompts)]
    assert [r[0] for r in results] == expected
    assert results[0][1]["cached_tokens_by_source"]["l3"] == 64  # the first request after restart hits L3
    assert results[1][1]["cached_tokens"] == 0 and results[2][1]["cached_tokens"] == 0
    assert disk.counters["corrupt_deleted_total"] == 2 and not by_prompt[1].exists()


async def test_foreign_model_files_are_deleted_at_start(make_engine, tmp_path):
    first = make_engine(l3_dir=tmp_path, l3_min_free_bytes=0)
    await run(first, "a", prompt_of(6, 80), segs=A)
    first.stop()
    assert list(tmp_path.rglob("*.kv"))
    other = make_engine(model="random-small", l3_dir=tmp_path, l3_min_free_bytes=0)
    assert other.store.disk.counters["foreign_deleted_total"] >= 1
    assert not [p for p in tmp_path.rglob("*.kv") if other.store.disk.dir not in p.parents]


async def test_full_disk_stops_the_tier_and_requests_still_succeed(make_engine, tmp_path):
    free = shutil.disk_usage(tmp_path).free
    engine = make_engine(num_blocks=24, l2_bytes=2 * BLOCK_BYTES, l3_dir=tmp_path, l3_min_free_bytes=free * 2)
    prompt = prompt_of(7, 80)
    expected, _, _ = await run(engine, "ref", prompt, use_cache=False)
    await run(engine, "first", prompt, segs=A)
    await push_out_of_l1(engine)
    engine.store.wait_for_writes()
    got, _, _ = await run(engine, "again", prompt, segs=A)
    assert got == expected
    disk = engine.stats()["tiers"]["l3"]
    assert disk["accepting"] == 0 and disk["write_errors_total"] >= 1
    assert not list(tmp_path.rglob("*.kv"))


async def test_namespaces_are_isolated_in_every_tier_and_after_restart(make_engine, tmp_path):
    prompt = prompt_of(8, 80)
    engine = make_engine(num_blocks=24, l2_bytes=4 * BLOCK_BYTES, l3_dir=tmp_path, l3_min_free_bytes=0)
    await run(engine, "a", prompt, segs=A)
    await push_out_of_l1(engine)
    engine.store.wait_for_writes()
    _, usage_b, _ = await run(engine, "b", prompt, segs=B)
    assert usage_b["cached_tokens"] == 0
    engine.stop()
    restarted = make_engine(l3_dir=tmp_path, l3_min_free_bytes=0)
    c = segments(b"key-of-tenant-c!" * 2, "t-c")
    _, usage_c, _ = await run(restarted, "c", prompt, segs=c)
    assert usage_c["cached_tokens"] == 0
    _, usage_a2, _ = await run(restarted, "a2", prompt, segs=A)
    assert usage_a2["cached_tokens"] == 64 and usage_a2["cached_tokens_by_source"]["l3"] > 0


async def test_purge_erases_a_namespace_from_every_tier_and_disk(make_engine, tmp_path):
    engine = make_engine(num_blocks=24, l2_bytes=8 * BLOCK_BYTES, l3_dir=tmp_path, l3_min_free_bytes=0)
    for i in range(3):
        await run(engine, f"a{i}", prompt_of(20 + i, 80), segs=A)
    await run(engine, "b", prompt_of(30, 80), segs=B)
    await push_out_of_l1(engine)
    engine.store.wait_for_writes()
    assert any("t-a" in str(p) for p in tmp_path.rglob("*.kv"))
    erased, failed = await engine.purge("t-a")
    assert not failed
    assert erased["l1"] + erased["l2"] + erased["l3"] > 0
    assert not any("t-a" in str(p) for p in tmp_path.rglob("*.kv"))
    assert any("t-b" in str(p) for p in tmp_path.rglob("*.kv"))
    _, usage, _ = await run(engine, "a-again", prompt_of(20, 80), segs=A)
    assert usage["cached_tokens"] == 0


def test_cost_gate_recomputes_when_loading_is_slower(make_engine):
    engine = make_engine()
    store = engine.store
    engine.prefill_tokens_per_s = 16_000.0  # 1 ms per 16-token block
    store.bandwidth["l2"].bps = 1e9  # 8 KB block in 8 µs: load
    assert store.worth_loading("l2", 10)
    store.bandwidth["l2"].bps = 1e6  # 8 ms per block: recompute
    assert not store.worth_loading("l2", 10)


async def test_redis_tier_is_shared_between_workers_and_keeps_namespaces_apart(make_engine, kv_redis_url):
    producer = make_engine(num_blocks=24, l2_bytes=4 * BLOCK_BYTES, remote_url=kv_redis_url)
    prompt = prompt_of(40, 80)
    expected, _, _ = await run(producer, "ref", prompt, use_cache=False)
    await run(producer, "first", prompt, segs=A)
    await push_out_of_l1(producer)
    producer.store.wait_for_writes()
    consumer = make_engine(remote_url=kv_redis_url)
    _, usage_b, _ = await run(consumer, "other-tenant", prompt, segs=B)
    assert usage_b["cached_tokens"] == 0
    got, usage, _ = await run(consumer, "same-tenant", prompt, segs=A)
    assert got == expected
    assert usage["cached_tokens_by_source"]["remote"] > 0


async def test_redis_stopping_mid_run_only_causes_misses(make_engine, private_redis):
    port, server = private_redis
    engine = make_engine(num_blocks=24, l2_bytes=4 * BLOCK_BYTES, remote_url=f"redis://127.0.0.1:{port}/0")
    await run(engine, "first", prompt_of(50, 80), segs=A)
    await push_out_of_l1(engine, 3)
    engine.store.wait_for_writes()
    server.terminate()
    server.wait(timeout=10)
    prompts = [prompt_of(60 + i, 80) for i in range(4)]
    expected = [(await run(engine, f"ref{i}", p, use_cache=False))[0] for i, p in enumerate(prompts)]
    got = []
    for i, p in enumerate(prompts):
        got.append((await run(engine, f"down{i}", p, segs=A, params=greedy()))[0])
        await push_out_of_l1(engine, 2)
    engine.store.wait_for_writes()
    _, usage, _ = await run(engine, "first-again", prompt_of(50, 80), segs=A)
    assert got == expected
    assert engine.stats()["tiers"]["remote"]["errors_total"] >= 1
    assert usage["completion_tokens"] == 12
    _, failed = await engine.purge("t-a")  # a data deletion must say it could not reach Redis
    assert "remote" in failed


def test_redis_quota_partition_protects_a_dedicated_namespace(kv_redis_url):
    tier = _remote_tier(kv_redis_url, b"quota-test" * 4, budget_bytes=20 * 9000)
    tier.set_reservation("t-dedicated", 10 * 9000)

    def blocks(ns: str, first: int, count: int):
        return [_demoted(ns, i) for i in range(first, first + count)]

    mine = blocks("t-dedicated", 0, 8)
    tier.put(mine)
    tier.put(blocks("t-other", 100, 60))  # three times the shared budget: the shared LRU evicts its own
    hashes = [b.record.block_hash for b in mine]
    records, data = tier.get_run(["t-dedicated"] * 8, hashes, [list(range(16))] * 8)
    assert len(records) == 8 and data is not None and data[3].flatten()[0].item() == 3.0
    others = [b.record.block_hash for b in blocks("t-other", 100, 60)]
    survivors, _ = tier.get_run(["t-other"] * 60, others, [list(range(16))] * 60)
    assert len(survivors) < 30  # the first ones were evicted to fit the shared budget
    assert tier.purge("t-dedicated") == 8
    assert tier.get_run(["t-dedicated"], hashes[:1], [list(range(16))])[0] == []


def test_redis_quotas_share_half_the_budget_and_a_shrunk_partition_is_trimmed(kv_redis_url):
    tier = _remote_tier(kv_redis_url, b"quota-shrink-test" * 2, budget_bytes=20 * 9000)
    tier.set_reservation("t-a", 10 * 9000)  # half the budget: granted whole
    assert tier._quotas == {"t-a": 10 * 9000} and tier._accounting("t-x")[1] == 10 * 9000
    tier.put([_demoted("t-a", i) for i in range(9)])
    part_bytes = tier._partition("t-a")[2]
    assert int(tier.client.get(part_bytes)) > 5 * 9000
    tier.set_reservation("t-b", 10 * 9000)  # a second dedicated owner: the half is split between them
    assert tier._quotas == {"t-a": 5 * 9000, "t-b": 5 * 9000}
    assert tier._accounting("t-x")[1] == 10 * 9000  # the shared LRU keeps the other half
    tier.put([_demoted("t-b", 100)])  # the next write trims A's partition to its new quota
    assert int(tier.client.get(part_bytes)) <= 5 * 9000
    assert 0 < len(_held(tier, "t-a", range(9))) < 9
    tier.set_reservation("t-a", 0)  # no reservation any more: the partition is emptied, B gets the half
    assert tier._quotas == {"t-b": 10 * 9000}
    tier.put([_demoted("t-x", 200)])
    assert int(tier.client.get(part_bytes)) == 0 and _held(tier, "t-a", range(9)) == []


def _remote_tier(url: str, fingerprint: bytes, budget_bytes: int):
    import torch

    from worker.tiers.remote import RemoteTier

    return RemoteTier(
        url,
        fingerprint=fingerprint,
        codec="none",
        block_shape=(2, 2, 16, 2, 16),
        dtype=torch.float32,
        budget_bytes=budget_bytes,
        ttl_s=60,
        timeout_s=1.0,
    )


def _demoted(ns: str, i: int, position: int = 0):
    import torch

    from worker.tiers.entry import BlockRecord
    from worker.tiers.host import DemotedBlock

    return DemotedBlock(
        record=BlockRecord(
            block_hash=bytes([i % 256, i // 256]) * 16, parent_hash=None, token_ids=tuple(range(16))
        ),
        namespace_id=ns,
        position=position,
        data=torch.full((2, 2, 16, 2, 16), float(i)),
    )


def _held(tier, ns: str, ids: range) -> list[int]:
    return [i for i in ids if tier.client.exists(tier.key(ns, _demoted(ns, i).record.block_hash))]


def test_redis_over_budget_by_one_entry_evicts_only_the_oldest(kv_redis_url):
    """The eviction script popped 16 victims at a time: one entry too many wiped 7 of 7 entries."""
    tier = _remote_tier(kv_redis_url, b"evict-just-enough" * 2, budget_bytes=1 << 30)
    tier.put([_demoted("t-a", 0)])
    tier.budget_bytes = 6 * int(tier.client.get(tier._total))
    for i in range(1, 7):
        time.sleep(0.002)  # distinct write times
        tier.put([_demoted("t-a", i)])
    assert tier.counters["blocks_evicted_total"] == 1
    assert _held(tier, "t-a", range(7)) == [1, 2, 3, 4, 5, 6]


def test_redis_evicts_a_chain_tail_first_within_one_write(kv_redis_url):
    tier = _remote_tier(kv_redis_url, b"evict-tail-first" * 2, budget_bytes=1 << 30)
    tier.put([_demoted("t-a", 100)])
    entry = int(tier.client.get(tier._total))
    tier.client.delete(
        tier._lru, tier._sizes, tier._total, tier.key("t-a", _demoted("t-a", 100).record.block_hash)
    )
    tier.budget_bytes = 5 * entry
    chain = [_demoted("t-a", i, position=i) for i in range(8)]  # one write, one millisecond
    tier.put(chain)
    assert tier.counters["blocks_evicted_total"] == 3
    assert _held(tier, "t-a", range(8)) == [0, 1, 2, 3, 4]  # the head survives; the tail went first


def test_redis_purge_erases_the_namespace_of_every_model(kv_redis_url):
    """Review r17: the purge scanned only this model's keys, so a purged tenant's blocks cached before a
    model upgrade (another fingerprint, same Redis) stayed until their TTL."""
    old = _remote_tier(kv_redis_url, b"purge-old-model!" * 2, budget_bytes=1 << 30)
    new = _remote_tier(kv_redis_url, b"purge-new-model!" * 2, budget_bytes=1 << 30)
    old.put([_demoted("t-gone", i) for i in range(3)] + [_demoted("t-gone:x", 9), _demoted("t-kept", 7)])
    new.put([_demoted("t-gone", 4)])
    kept_bytes = int(old.client.hget(old._sizes, old.key("t-kept", _demoted("t-kept", 7).record.block_hash)))

    assert new.purge("t-gone") == 4
    assert _held(old, "t-gone", range(3)) == [] and _held(new, "t-gone", range(5)) == []
    assert _held(old, "t-gone:x", range(9, 10)) == [9] and _held(old, "t-kept", range(7, 8)) == [7]
    entry = int(old.client.hget(old._sizes, old.key("t-gone:x", _demoted("t-gone:x", 9).record.block_hash)))
    assert int(old.client.get(old._total)) == kept_bytes + entry  # the old model's books follow
    assert old.client.zcard(old._lru) == 2 and int(new.client.get(new._total)) == 0
