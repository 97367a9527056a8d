"""KV events: the ring log, the block manager's hooks, and ``GET /v1/kv_events`` on a real worker."""

import aiohttp
import pytest

from policies.hashing import BlockHash, NamespaceSegment, block_hashes
from tests.worker_process import worker_process
from worker.block_manager import BlockManager
from worker.kv_events import BLOCK_REMOVED, BLOCK_STORED, KVEventLog, attach

KEY = "00112233445566778899aabbccddeeff"


def h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


def test_log_replays_from_any_sequence_number_and_resets_when_the_ring_lost_events():
    log = KVEventLog(capacity_events=4)
    for i in range(3):
        log.stored("L1", h(i), None if i == 0 else h(i - 1), "t-a")
    assert [e.seq for e in log.since(0).events] == [1, 2, 3]
    assert [e.seq for e in log.since(2).events] == [3]
    assert log.since(3).events == [] and not log.since(3).reset
    log.removed("L1", h(2))
    log.removed("L1", h(1))  # seq 5: seq 1 falls out of the ring
    batch = log.since(0)
    assert batch.reset and batch.last_seq == 5
    assert not log.since(1).reset and [e.seq for e in log.since(1).events] == [2, 3, 4, 5]
    assert log.since(9).reset  # a consumer ahead of the log: the worker restarted
    assert [e.seq for e in log.since(1, max_events=2).events] == [2, 3]


def test_block_manager_publishes_stores_evictions_and_purges():
    log = KVEventLog()
    bm = BlockManager(2, 4, eviction_policy="lru")
    attach(log, bm, "L1")
    first = bm.allocate("t-a")
    assert bm.cache(first, h(1), [1, 2, 3, 4], None, namespace_id="t-a", position=0)
    second = bm.allocate("t-a")
    assert bm.cache(second, h(2), [5, 6, 7, 8], h(1), namespace_id="t-a", position=1)
    bm.release([first, second])
    stored = log.since(0).events
    assert [(e.kind, e.block_hash, e.parent_hash, e.namespace_id) for e in stored] == [
        (BLOCK_STORED, h(1), None, "t-a"),
        (BLOCK_STORED, h(2), h(1), "t-a"),
    ]
    bm.allocate("t-b")  # the pool is full: the leaf h(2) is evicted
    assert [(e.kind, e.block_hash) for e in log.since(2).events] == [(BLOCK_REMOVED, h(2))]
    assert bm.purge("t-a") == 1
    assert [(e.kind, e.block_hash, e.medium) for e in log.since(3).events] == [(BLOCK_REMOVED, h(1), "L1")]


@pytest.fixture(scope="module")
def worker_url(tmp_path_factory):
    log = tmp_path_factory.mktemp("kv-events-worker") / "worker.log"
    with worker_process(
        "--model", "random-tiny", "--num-blocks", "64", "--max-model-len", "1008", log_path=log
    ) as url:
        yield url


async def events(session: aiohttp.ClientSession, url: str, **query) -> tuple[int, dict]:
    async with session.get(f"{url}/v1/kv_events", params={k: str(v) for k, v in query.items()}) as r:
        return r.status, await r.json()


async def test_worker_streams_namespaced_block_events_with_replay(worker_url):
    prompt = list(range(100, 140))  # 2 full blocks of 16
    payload = {
        "request_id": "kv-1",
        "prompt_token_ids": prompt,
        "namespace": [{"start_token": 0, "namespace_id": "t-kv", "key": KEY}],
        "sampling": {"max_tokens": 2, "temperature": 0, "ignore_eos": True},
    }
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{worker_url}/v1/info") as r:
            info = await r.json()
        _, before = await events(s, worker_url, since=0)
        start = before["last_seq"]
        async with s.post(f"{worker_url}/v1/generate", json=payload) as r:
            assert r.status == 200
        status, body = await events(s, worker_url, since=start, wait_ms=2000)
        assert status == 200 and body["worker_id"] == info["worker_id"] and not body["reset"]
        segments = [NamespaceSegment(start_token=0, namespace_id="t-kv", key=bytes.fromhex(KEY))]
        expected = block_hashes(prompt, 16, bytes.fromhex(info["model_fingerprint"]), segments)
        stored = [e for e in body["events"] if e["type"] == BLOCK_STORED and e["namespace_id"] == "t-kv"]
        assert [e["block_hashes"][0] for e in stored[:2]] == [x.hex() for x in expected]
        assert stored[0]["parent_block_hash"] is None and stored[1]["parent_block_hash"] == expected[0].hex()
        assert all(e["medium"] == "L1" for e in stored)
        assert [e["seq"] for e in body["events"]] == list(range(start + 1, body["last_seq"] + 1))
        assert set(body["load"]) >= {"num_running", "num_waiting", "queued_prefill_tokens"}
        _, again = await events(s, worker_url, since=start)  # replay after a reconnect: the same events
        assert again["events"] == body["events"]
        _, idle = await events(s, worker_url, since=body["last_seq"], wait_ms=50)
        assert idle["events"] == [] and not idle["reset"]
        async with s.post(f"{worker_url}/v1/purge", json={"namespace_id": "t-kv"}) as r:
            assert r.status == 200
        _, purged = await events(s, worker_url, since=body["last_seq"], wait_ms=2000)
        removed = {e["block_hashes"][0] for e in purged["events"] if e["type"] == BLOCK_REMOVED}
        assert {x.hex() for x in expected} <= removed
        status, bad = await events(s, worker_url, since="x")
        assert status == 400 and bad["error"]["param"] == "since"


def blocks_of(events: list[dict]) -> list[tuple[str, str, str]]:
    """(medium, hash hex, namespace) of every block in snapshot events, in order."""
    return [(e["medium"], x, e["namespace_id"]) for e in events for x in e["block_hashes"]]


def test_a_consumer_behind_the_ring_gets_a_paged_snapshot_frozen_at_one_sequence_number():
    log = KVEventLog(capacity_events=4)
    for i in range(1, 7):  # a chain of 6 blocks on disk: more than the ring holds
        log.stored("L3", h(i), None if i == 1 else h(i - 1), "t-a")
    log.stored("L1", h(7), None, "t-b")
    log.removed("L3", h(6))
    assert log.since(0).reset  # replaying the ring cannot rebuild this
    first = log.read(0, max_events=4)
    assert first.reset and first.snapshot is not None and first.snapshot.seq == 8 == log.last_seq
    assert first.snapshot.num_blocks == 6 and first.snapshot.next_cursor is not None
    # vLLM's shape: one BlockStored per chain of one tier and namespace, the first block's parent
    assert first.snapshot.events == [
        {
            "type": BLOCK_STORED,
            "medium": "L3",
            "block_hashes": [h(i).hex() for i in range(1, 5)],
            "parent_block_hash": None,
            "namespace_id": "t-a",
        }
    ]
    log.removed("L3", h(2))  # changes while the consumer reads the pages: in the events after seq 8
    log.stored("L1", h(8), h(7), "t-b")
    second = log.read(0, cursor=first.snapshot.next_cursor, max_events=4)
    assert not second.reset and second.snapshot is not None and second.snapshot.next_cursor is None
    assert second.snapshot.events[0]["parent_block_hash"] == h(4).hex()
    assert blocks_of(second.snapshot.events) == [("L3", h(5).hex(), "t-a"), ("L1", h(7).hex(), "t-b")]
    after = log.read(first.snapshot.seq)
    assert not after.reset and after.snapshot is None
    assert [(e.seq, e.kind, e.block_hash) for e in after.events] == [
        (9, BLOCK_REMOVED, h(2)),
        (10, BLOCK_STORED, h(8)),
    ]
    # A finished (or unknown, or expired) snapshot's cursor starts a new one at the current state.
    log.cleared("L1")
    again = log.read(0, cursor=first.snapshot.next_cursor, max_events=100)
    assert again.reset and again.snapshot is not None and again.snapshot.seq == 11
    assert blocks_of(again.snapshot.events) == [("L3", h(i).hex(), "t-a") for i in (1, 3, 4, 5)]
    assert log.read(99).snapshot is not None  # a consumer ahead of the log (a restart) gets one too


def test_a_bounded_tiers_state_keeps_blocks_for_their_ttl_and_no_more_than_the_tier_holds():
    """r7 #4: the ``remote`` state only forgot blocks this worker saw leave; Redis expires blocks and other
    workers' writes evict them unannounced, so every snapshot re-announced all blocks ever written."""
    now = [0.0]
    log = KVEventLog(capacity_events=2, clock=lambda: now[0])
    log.bound("remote", ttl_s=10.0, max_blocks=3)

    def state() -> list[tuple[str, str, str]]:
        page = log.read(0, max_events=100).snapshot
        assert page is not None  # the ring (2 events) is outrun: a snapshot is served
        return blocks_of(page.events)

    for i in range(3):  # announced at 0, 1 and 2 s
        log.stored("remote", h(i), None, "t-a")
        now[0] += 1.0
    log.stored("L1", h(50), None, "t-b")  # an unbounded tier: kept whatever the time
    now[0] = 11.5  # h(0) and h(1) were announced more than 10 s ago: Redis expired them
    assert state() == [("remote", h(2).hex(), "t-a"), ("L1", h(50).hex(), "t-b")]
    for i in (3, 4, 2, 5):  # h(2) announced again (a read refreshed its TTL): now more recent than h(3)
        log.stored("remote", h(i), None, "t-a")
    assert sorted(state()) == sorted(
        [("remote", h(i).hex(), "t-a") for i in (4, 2, 5)] + [("L1", h(50).hex(), "t-b")]
    )  # 4 announced, the tier holds 3: the least recently announced (h(3)) has left it
    for i in range(10, 20):  # between snapshots the state holds at most twice the tier (a write's slack)
        log.stored("remote", h(i), None, "t-a")
    assert len(log._state["remote"]) == 6
    now[0] = 30.0
    assert state() == [("L1", h(50).hex(), "t-b")]
