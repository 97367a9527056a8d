"""KV events from the disk (L3) and Redis tiers: what a restarted worker's disk holds is announced, every
removal (eviction, purge, damage) is published, and a block in shared Redis is credited by the gateway's
index to every worker sharing that Redis, never across namespaces."""

from __future__ import annotations

import time

import pytest
import torch

from gateway.kv_index import TIER_WEIGHTS, PrefixIndex
from policies.hashing import block_hashes
from tests.worker.conftest import prompt_of, run, segments
from tests.worker.test_tiers import BLOCK_BYTES, push_out_of_l1
from worker.engine import Engine
from worker.kv_events import BLOCK_REMOVED, BLOCK_STORED, STATE_SLACK, KVEventLog, TierEvents
from worker.tiers.disk import DiskTier
from worker.tiers.entry import BlockRecord, encode_entry
from worker.tiers.host import DemotedBlock
from worker.tiers.remote import RemoteTier

A = segments(b"key-of-tenant-a!" * 2, "t-a")
B = segments(b"key-of-tenant-b!" * 2, "t-b")
SHAPE = (2, 2, 16, 2, 16)  # random-tiny's block: layers, k/v, tokens, kv heads, head dim


def hashes_of(engine: Engine, prompt: list[int], segs=A) -> list[bytes]:
    return block_hashes(prompt, 16, engine.fingerprint, segs)


def held(log: KVEventLog, medium: str) -> dict[bytes, str]:
    """Replay the log: the blocks ``medium`` holds now (hash -> namespace id)."""
    state: dict[bytes, str] = {}
    for event in log.since(0, max_events=1 << 20).events:
        if event.medium != medium:
            continue
        if event.kind == BLOCK_STORED:
            state[event.block_hash] = event.namespace_id
        elif event.kind == BLOCK_REMOVED:
            state.pop(event.block_hash, None)
    return state


def batch_of(engine: Engine, worker_id: str) -> dict:
    """What ``GET /v1/kv_events?since=0`` answers (worker.server.kv_events)."""
    batch = engine.kv_events.since(0, max_events=1 << 20)
    return {
        "worker_id": worker_id,
        "last_seq": batch.last_seq,
        "reset": batch.reset,
        "events": [event.to_json() for event in batch.events],
        "remote_tier": engine.store.remote_tier() if engine.store is not None else None,
    }


async def test_restarted_worker_announces_its_disk_and_every_removal(make_engine, tmp_path):
    first = make_engine(l3_dir=tmp_path, l3_min_free_bytes=0)
    prompt_a, prompt_b = prompt_of(3, 80), prompt_of(4, 80)
    await run(first, "a", prompt_a, segs=A)
    await run(first, "b", prompt_b, segs=B)
    first.stop()  # flushes L1 to disk
    hashes_a, hashes_b = hashes_of(first, prompt_a)[:5], hashes_of(first, prompt_b, B)[:5]

    second = make_engine(l3_dir=tmp_path, l3_min_free_bytes=0)
    on_disk = held(second.kv_events, "L3")  # announced before any request: the files found at start-up
    assert on_disk == {**dict.fromkeys(hashes_a, "t-a"), **dict.fromkeys(hashes_b, "t-b")}
    first_events = second.kv_events.since(0).events
    assert first_events[0].seq == 1 and {e.medium for e in first_events[:10]} == {"L3"}
    for event in first_events:  # ids and hashes only: no token or text leaves the worker
        assert set(event.to_json()) <= {
            "seq",
            "type",
            "medium",
            "block_hashes",
            "parent_block_hash",
            "namespace_id",
        }
    stored = [e for e in first_events if e.medium == "L3"]
    assert [e.parent_hash for e in stored if e.namespace_id == "t-a"] == [None, *hashes_a[:-1]]

    # A damaged file is deleted at read time: its blocks are announced removed.
    (path,) = [p for p in tmp_path.rglob("*.kv") if p.name == f"{hashes_b[0].hex()}.kv"]
    damaged = bytearray(path.read_bytes())
    damaged[-5] ^= 0xFF
    path.write_bytes(bytes(damaged))
    _, usage, _ = await run(second, "b-again", prompt_b, segs=B)
    assert usage["cached_tokens"] == 0
    assert not set(hashes_b) & set(held(second.kv_events, "L3"))

    # A purge removes the namespace from the disk's events (and nothing of the other namespace).
    _, usage, _ = await run(second, "a-again", prompt_a, segs=A)
    assert usage["cached_tokens_by_source"]["l3"] == 64
    erased, failed = await second.purge("t-a")
    assert erased["l3"] == 5 and not failed
    assert held(second.kv_events, "L3") == {}  # t-b's only file was the damaged one
    for medium in ("L1", "L2"):
        assert "t-a" not in held(second.kv_events, medium).values()


def _blocks(namespace_id: str, seed: int, count: int) -> list[DemotedBlock]:
    tokens = [(seed * 31 + i) % 251 for i in range(16 * count)]
    hashes = block_hashes(tokens, 16, b"events", segments(b"k" * 32, namespace_id))
    return [
        DemotedBlock(
            record=BlockRecord(
                block_hash=h,
                parent_hash=hashes[k - 1] if k else None,
                token_ids=tuple(tokens[16 * k : 16 * k + 16]),
            ),
            namespace_id=namespace_id,
            position=k,
            data=torch.full(SHAPE, float(seed + k)),
        )
        for k, h in enumerate(hashes)
    ]


def test_disk_eviction_is_announced(tmp_path):
    log = KVEventLog()
    disk = DiskTier(
        tmp_path,
        budget_bytes=3 * (4 * BLOCK_BYTES + 2048),  # about three 4-block files
        fingerprint=b"events" * 6,
        codec="none",
        block_shape=SHAPE,
        dtype=torch.float32,
        min_free_bytes=0,
        events=TierEvents(log, "L3"),
    )
    chains = [_blocks("t-a", seed, 4) for seed in range(6)]
    for chain in chains:
        assert disk.write(chain) == 4
    assert disk.counters["files_evicted_total"] >= 1
    assert set(held(log, "L3")) == set(disk.index)  # the events say exactly what the index holds


def _disk(root, budget_bytes: int, log: KVEventLog | None = None) -> DiskTier:
    return DiskTier(
        root,
        budget_bytes=budget_bytes,
        fingerprint=b"events" * 6,
        codec="none",
        block_shape=SHAPE,
        dtype=torch.float32,
        min_free_bytes=0,
        max_blocks_per_file=16,
        events=None if log is None else TierEvents(log, "L3"),
    )


def _batch(log: KVEventLog, since: int, capacity: dict[str, int]) -> dict:
    """What ``GET /v1/kv_events?since=…`` answers with the consumer's default page (4096 events)."""
    batch = log.since(since, max_events=4096)
    return {
        "worker_id": "w1",
        "last_seq": batch.last_seq,
        "reset": batch.reset,
        "events": [event.to_json() for event in batch.events],
        "capacity_blocks": capacity,
    }


def test_a_disk_restarted_with_a_smaller_budget_announces_only_the_files_it_keeps(tmp_path):
    before = _disk(tmp_path, budget_bytes=64 << 20)
    for seed in range(100):  # 1600 blocks on disk
        assert before.write(_blocks(f"t-{seed % 4}", seed, 16)) == 16
    before.close()  # the worker stopped
    log = KVEventLog()
    after = _disk(tmp_path, budget_bytes=64 * BLOCK_BYTES, log=log)  # the operator shrank --l3-bytes
    assert 0 < len(after.index) <= 64
    events = log.since(0, max_events=1 << 20).events
    # Before: 1600 BlockStored, then 1536+ BlockRemoved of blocks nobody had been told about.
    assert {e.kind for e in events} == {BLOCK_STORED}
    assert [e.block_hash for e in events] == [r.block_hash for f in after.files.values() for r in f.records]
    capacity = {"L1": 64, "L2": 16, "L3": after.budget_bytes // after.block_payload_bytes}
    index = PrefixIndex()
    index.apply("http://w", _batch(log, 0, capacity))  # before: refused as "more blocks than its tiers hold"
    assert set(index.workers["http://w"].blocks) == set(after.index)


def _events_tier(
    url: str,
    *,
    fingerprint: bytes = b"remote-event-state" * 2,
    budget_bytes: int = 1 << 20,
    ttl_s: float = 60,
    capacity_events: int = 1 << 17,
) -> tuple[RemoteTier, KVEventLog]:
    """A Redis tier of ``fingerprint`` (each test its own: its keys apart) announcing to its own log."""
    log = KVEventLog(capacity_events=capacity_events)
    remote = RemoteTier(
        url,
        fingerprint=fingerprint,
        codec="none",
        block_shape=SHAPE,
        dtype=torch.float32,
        budget_bytes=budget_bytes,
        ttl_s=ttl_s,
        timeout_s=1.0,
        events=TierEvents(log, "remote"),
    )
    return remote, log


def test_a_redis_entry_listing_no_blocks_is_a_miss_and_deleted(kv_redis_url):
    remote, _ = _events_tier(kv_redis_url, fingerprint=b"no-blocks!" * 4)
    (block,) = _blocks("t-a", 1, 1)
    key = remote.key("t-a", block.record.block_hash)
    empty = encode_entry(
        fingerprint=remote.fingerprint,
        namespace_id="t-a",
        codec="none",
        dtype="float32",
        block_shape=SHAPE,
        blocks=[],
        payloads=[],
    )  # a valid header checksum over a header that lists no block
    remote.client.set(key, empty)
    # Before: IndexError out of get_run (the prefetch that asked failed, not a miss).
    assert remote.get_run(["t-a"], [block.record.block_hash], [block.record.token_ids]) == ([], None)
    assert remote.counters["corrupt_deleted_total"] == 1 and not remote.client.exists(key)


def test_redis_events_name_written_evicted_and_purged_blocks(kv_redis_url):
    def tier(budget_bytes: int, fingerprint: bytes = b"events-redis" * 3) -> tuple[RemoteTier, KVEventLog]:
        return _events_tier(kv_redis_url, fingerprint=fingerprint, budget_bytes=budget_bytes)

    entry_bytes = torch.Size(SHAPE).numel() * 4 + 2000  # payload and header of a one-block entry
    writer, log = tier(budget_bytes=6 * entry_bytes)
    reader, reader_log = tier(budget_bytes=6 * entry_bytes)
    other_model, _ = tier(budget_bytes=1 << 20, fingerprint=b"another-model" * 3)
    assert writer.identify() and writer.identify() == reader.identify() != other_model.identify()

    first, second = _blocks("t-a", 1, 4), _blocks("t-b", 2, 4)
    writer.put(first)
    assert held(log, "remote") == {b.record.block_hash: "t-a" for b in first}
    writer.put(second)  # over the budget: the oldest keys are evicted, and named
    assert writer.counters["blocks_evicted_total"] >= 1
    in_redis = {
        bytes.fromhex(key.decode().rsplit(":", 1)[1])
        for key in writer.client.scan_iter(match=f"{writer.prefix}:t-*")
    }
    assert set(held(log, "remote")) == in_redis

    # A read by another worker re-announces what it found (the hit refreshed the TTL).
    writer.budget_bytes = 1 << 20
    third = _blocks("t-b", 3, 4)
    writer.put(third)
    records, _ = reader.get_run(
        ["t-b"] * 4, [b.record.block_hash for b in third], [b.record.token_ids for b in third]
    )
    assert len(records) == 4 and set(held(reader_log, "remote")) == {b.record.block_hash for b in third}
    erased = reader.purge("t-b")
    assert erased >= 4 and held(reader_log, "remote") == {}


async def test_index_credits_redis_blocks_to_every_worker_sharing_the_redis(make_engine, kv_redis_url):
    producer = make_engine(num_blocks=24, l2_bytes=4 * BLOCK_BYTES, remote_url=kv_redis_url)
    prompt = prompt_of(40, 80)
    await run(producer, "first", prompt, segs=A)
    await push_out_of_l1(producer)
    producer.store.wait_for_writes()
    consumer = make_engine(remote_url=kv_redis_url)
    local_only = make_engine()
    tier_id = producer.store.remote_tier()["id"]
    assert consumer.store.remote_tier()["id"] == tier_id

    index = PrefixIndex()
    for url, engine in (("http://p", producer), ("http://c", consumer), ("http://l", local_only)):
        index.apply(url, batch_of(engine, url))
    hashes = hashes_of(producer, prompt)
    in_redis = [h for h in hashes if h in held(producer.kv_events, "remote")]
    assert in_redis  # the evicted chain reached Redis
    found = index.match("http://c", hashes, ["t-a"] * len(hashes))
    assert found.num_blocks >= 1
    assert found.weighted_blocks == pytest.approx(found.num_blocks * TIER_WEIGHTS["remote"])
    assert index.match("http://l", hashes, ["t-a"] * len(hashes)).num_blocks == 0  # no Redis: no credit
    other_ns = block_hashes(prompt, 16, producer.fingerprint, B)
    assert index.match("http://c", other_ns, ["t-b"] * len(hashes)).num_blocks == 0

    # The consumer really restores them from Redis, then a purge through it removes them everywhere.
    _, usage, _ = await run(consumer, "from-redis", prompt, segs=A)
    assert usage["cached_tokens_by_source"]["remote"] == min(found.num_blocks, 4) * 16
    _, failed = await consumer.purge("t-a")
    assert not failed
    index.apply("http://c", batch_of(consumer, "http://c"))
    assert index.shared[tier_id] == {}  # every t-a key the purge erased from Redis, announced
    assert index.match("http://c", hashes, ["t-a"] * len(hashes)).num_blocks == 0


def test_a_read_racing_a_purge_neither_rebooks_nor_reannounces_the_purged_blocks(kv_redis_url, monkeypatch):
    def tier() -> tuple[RemoteTier, KVEventLog]:
        return _events_tier(kv_redis_url, fingerprint=b"purge-race" * 4)

    purger, _ = tier()
    reader, reader_log = tier()
    blocks = _blocks("t-a", 5, 4)
    purger.put(blocks)
    read = reader.client.mget

    def read_then_purge(keys):  # the purge lands between the read and the TTL refresh
        values = read(keys)
        assert purger.purge("t-a") == 4
        return values

    monkeypatch.setattr(reader.client, "mget", read_then_purge)
    records, _ = reader.get_run(
        ["t-a"] * 4, [b.record.block_hash for b in blocks], [b.record.token_ids for b in blocks]
    )
    assert records == []  # the run ended with the keys: nothing purged is served from here on
    assert held(reader_log, "remote") == {}  # nor announced to the gateway's index
    keys = {reader.key("t-a", b.record.block_hash).encode() for b in blocks}
    assert keys.isdisjoint(reader.client.zrange(reader._lru, 0, -1))  # nor booked in the LRU
    assert not any(reader.client.exists(key) for key in keys)


def _snapshot_of(log: KVEventLog) -> set[bytes]:
    """The Redis blocks a gateway that fell behind the ring is sent (a snapshot's pages)."""
    page = log.read(0, max_events=1 << 20).snapshot
    assert page is not None
    return {bytes.fromhex(x) for e in page.events if e["medium"] == "remote" for x in e["block_hashes"]}


def _in_redis(remote: RemoteTier, namespace_id: str) -> set[bytes]:
    keys = remote.client.scan_iter(match=f"{remote.prefix}:{namespace_id}:*")
    return {bytes.fromhex(key.decode().rsplit(":", 1)[1]) for key in keys}


def test_blocks_redis_expired_leave_the_workers_state(kv_redis_url):
    """r7 #4: 100 blocks Redis had expired by TTL stayed in the worker's state, re-announced by every
    snapshot (with a fresh TTL at the gateway), growing without bound in a long-running worker."""
    remote, log = _events_tier(kv_redis_url, budget_bytes=1 << 24, ttl_s=2.0, capacity_events=16)
    for seed in range(25):
        remote.put(_blocks("t-a", seed, 4))
    assert _snapshot_of(log) == _in_redis(remote, "t-a") and len(_in_redis(remote, "t-a")) == 100
    deadline = time.monotonic() + 20
    while _in_redis(remote, "t-a") and time.monotonic() < deadline:  # Redis expires them (silently)
        time.sleep(0.2)
    assert _in_redis(remote, "t-a") == set()
    time.sleep(0.5)  # the worker's clock for a block starts when its write returned, after Redis's did
    assert _snapshot_of(log) == set() and log._state["remote"] == {}


def test_blocks_another_worker_evicted_leave_the_workers_state(kv_redis_url):
    """r7 #4: blocks another worker's writes evicted from the shared Redis stayed in this worker's state
    and snapshots (it only hears of the evictions its own writes cause)."""
    entry_bytes = torch.Size(SHAPE).numel() * 4 + 2000
    first, first_log = _events_tier(kv_redis_url, budget_bytes=6 * entry_bytes, capacity_events=16)
    second, _ = _events_tier(kv_redis_url, budget_bytes=6 * entry_bytes, capacity_events=16)
    early = _blocks("t-a", 1, 4)
    first.put(early)
    for seed in range(2, 12):  # the second worker's writes evict the first's blocks, unannounced to it
        second.put(_blocks("t-b", seed, 4))
    assert _in_redis(first, "t-a") == set()
    for seed in range(20, 30):  # the first worker writes on (its own evictions it announces)
        first.put(_blocks("t-a", seed, 4))
    held = _snapshot_of(first_log)
    assert held == _in_redis(first, "t-a") and held, "the snapshot must be what Redis holds of t-a"
    assert held.isdisjoint(b.record.block_hash for b in early)


class _CountingBlocks(dict):
    """A tier's KV-event state that counts the blocks a walk over it visits."""

    visits = 0

    def __iter__(self):
        for key in super().__iter__():
            self.visits += 1
            yield key


def test_a_grant_change_does_not_walk_the_tiers_whole_state(kv_redis_url):
    """r10 #2: every change of a dedicated tenant's grant re-bounds the Redis tier's state, and the bound
    walked every block announced so far (on the engine thread, under the log's lock): 20 grant changes
    with 20 000 blocks announced visited 400 000 of them."""
    remote, log = _events_tier(kv_redis_url, budget_bytes=1 << 30, ttl_s=3600, capacity_events=16)
    for i in range(20_000):  # what this worker wrote to Redis, announced
        log.stored("remote", i.to_bytes(32, "little"), None, "t-x")
    log._state["remote"] = blocks = _CountingBlocks(log._state["remote"])
    for k in range(20):  # a dedicated tenant arrives: the others' grants shrink
        remote.set_reservation(f"t-d{k}", (1 << 20) + k)
    visits = blocks.visits
    assert visits == 0 and len(_snapshot_of(log)) == 20_000
    per_block = remote.codec.payload_bytes(remote.block_shape, remote.dtype)
    remote.budget_bytes = 64 * per_block  # a smaller bound still trims the state at once
    remote.set_reservation("t-d0", 0)
    max_blocks = (remote.budget_bytes + sum(remote._quotas.values())) // per_block
    assert len(log._state["remote"]) == STATE_SLACK * max_blocks < 20_000
