"""The gateway's prefix index is bounded: Redis-tier entries that expired silently are freed, a tier keeps
no more than its budget holds, and one worker cannot grow its entry past what its tiers hold (a worker
that announces more is refused like a malformed batch, which drops it from the index)."""

import os

import pytest

from gateway.kv_index import CAPACITY_SLACK, DEFAULT_MAX_BLOCKS, MAX_BLOCKS, PrefixIndex, capacity_bound

TTL_S = 3600.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _batch(seq: int, hashes: list[str], *, medium: str, capacity=None, tier_capacity=None) -> dict:
    batch = {
        "worker_id": "w1",
        "last_seq": seq,
        "reset": False,
        "remote_tier": {"id": "tier-1", "ttl_s": TTL_S},
        "events": [
            {
                "seq": seq,
                "type": "BlockStored",
                "medium": medium,
                "namespace_id": "t-a",
                "block_hashes": hashes,
            }
        ],
        "load": {},
    }
    if not hashes:
        batch["events"] = []
    if capacity is not None:
        batch["capacity_blocks"] = capacity
    if tier_capacity is not None:
        batch["remote_tier"]["capacity_blocks"] = tier_capacity
    return batch


def _hashes(n: int) -> list[str]:
    return [os.urandom(32).hex() for _ in range(n)]


def test_redis_tier_entries_that_expired_unannounced_are_freed():
    clock = Clock()
    index = PrefixIndex(clock=clock)
    per_ttl = 2_000
    kept = _hashes(10)
    for period in range(10):
        index.apply("http://w1", _batch(period + 1, kept + _hashes(per_ttl), medium="remote"))
        clock.now += TTL_S / 2
        index.apply("http://w1", _batch(100 + period, kept, medium="remote"))  # announced again: still live
        clock.now += TTL_S / 2 + 1  # the rest expires in Redis (silently: no event)
    index.apply("http://w1", _batch(1000, [], medium="remote"))
    assert len(index.shared["tier-1"]) <= per_ttl + len(kept)  # before: 20,010 entries held
    live = {bytes.fromhex(h) for h in kept}
    assert live <= set(index.shared["tier-1"])
    assert index.match("http://w1", [bytes.fromhex(kept[0])], ["t-a"]).num_blocks == 1
    clock.now += 2 * TTL_S
    index.apply("http://w1", _batch(1001, [], medium="remote"))
    assert "tier-1" not in index.shared  # nothing live: the tier's entry is gone too


def test_a_redis_tier_keeps_no_more_than_its_budget_holds():
    index = PrefixIndex(clock=Clock())
    for seq in range(1, 6):
        index.apply("http://w1", _batch(seq, _hashes(1000), medium="remote", tier_capacity=100))
    assert len(index.shared["tier-1"]) == CAPACITY_SLACK * 100 + 1024  # the oldest announcements went


def test_one_worker_cannot_grow_the_index_past_what_its_tiers_hold():
    index = PrefixIndex()
    capacity = {"L1": 64, "L2": 256, "L3": 4096}
    bound = capacity_bound(capacity)
    assert bound == CAPACITY_SLACK * (64 + 256 + 4096) + 1024
    index.apply("http://w1", _batch(1, _hashes(bound - 10), medium="L3", capacity=capacity))
    assert len(index.workers["http://w1"].blocks) == bound - 10  # an honest worker is kept whole
    with pytest.raises(ValueError, match="more blocks than its tiers hold"):  # the consumer drops it
        index.apply("http://w1", _batch(2, _hashes(20_000), medium="L3", capacity=capacity))
    assert len(index.workers["http://w1"].blocks) == bound


def _events(kind: str, hashes: list[str], first_seq: int) -> list[dict]:
    return [
        {"seq": first_seq + i, "type": kind, "medium": "L3", "namespace_id": "t-a", "block_hashes": [h]}
        for i, h in enumerate(hashes)
    ]


def test_a_batch_that_nets_within_the_capacity_is_kept_whole():
    # A worker restarted on a disk holding more than its new budget (what an older worker announced):
    # every file found, then the evictions down to the budget, in one batch.
    capacity = {"L1": 0, "L2": 0, "L3": 64}
    bound = capacity_bound(capacity)
    found = _hashes(bound + 500)
    batch = _batch(0, [], medium="L3", capacity=capacity)
    batch["events"] = _events("BlockStored", found, 1) + _events("BlockRemoved", found[64:], len(found) + 1)
    batch["last_seq"] = batch["events"][-1]["seq"]
    index = PrefixIndex()
    index.apply("http://w1", batch)  # before: refused at entry `bound`, and again on every replay
    assert set(index.workers["http://w1"].blocks) == {bytes.fromhex(h) for h in found[:64]}


def test_a_batch_that_nets_past_the_capacity_is_refused_and_never_grows_past_its_removals():
    capacity = {"L1": 0, "L2": 0, "L3": 64}
    bound = capacity_bound(capacity)
    stored = _hashes(bound + 5_000)
    never_stored = _hashes(100)  # removals of unknown blocks buy a hostile worker no more than this
    batch = _batch(0, [], medium="L3", capacity=capacity)
    batch["events"] = _events("BlockRemoved", never_stored, 1) + _events("BlockStored", stored, 101)
    index = PrefixIndex()
    with pytest.raises(ValueError, match="more blocks than its tiers hold"):
        index.apply("http://w1", batch)
    assert len(index.workers["http://w1"].blocks) == bound + len(never_stored)
    batch["events"] = _events("BlockStored", stored[: bound + 10], 1) + _events("BlockRemoved", stored[:5], 1)
    with pytest.raises(ValueError, match="more blocks than its tiers hold"):  # nets at bound + 5
        PrefixIndex().apply("http://w1", batch)


def test_without_a_reported_capacity_the_default_bound_holds(monkeypatch):
    assert DEFAULT_MAX_BLOCKS == 1 << 18  # ~50 MB of entries for a worker that reports nothing
    monkeypatch.setattr("gateway.kv_index.DEFAULT_MAX_BLOCKS", 5_000)  # the same bound, smaller and fast
    index = PrefixIndex()
    with pytest.raises(ValueError):
        for seq in range(1, 20):  # before: 20 answers of 50k invented hashes were all kept (1,000,000)
            index.apply("http://w1", _batch(seq, _hashes(1_000), medium="L3"))
    assert len(index.workers["http://w1"].blocks) == 5_000
    assert capacity_bound({"L3": 10**12}) == MAX_BLOCKS  # a reported capacity is not trusted without end
    for malformed in ({"L1": "many"}, {"L1": -1}, [1, 2], True):
        with pytest.raises(ValueError):
            capacity_bound(malformed)


def _tier_batch(seq: int, tier_id, hashes: list[str], ttl_s=TTL_S, worker_id: str = "w1") -> dict:
    batch = _batch(seq, hashes, medium="remote")
    batch["worker_id"] = worker_id
    batch["remote_tier"] = {"id": tier_id, "ttl_s": ttl_s, "capacity_blocks": 1000}
    return batch


def test_one_worker_keeps_the_entries_of_one_redis_tier_at_a_time():
    bound = capacity_bound(1000)
    index = PrefixIndex(clock=Clock())
    for seq in range(1, 11):  # a hostile worker names a new tier id in each batch, each one filled
        index.apply("http://w1", _tier_batch(seq, f"tier-{seq}", _hashes(bound), ttl_s=1e9))
    # Before: every id kept its own capped dict: 10 tiers, 10 x bound entries (20 x 20,000 in review r9).
    assert list(index.shared) == ["tier-10"] and len(index.shared["tier-10"]) == bound
    index.drop("http://w1")  # kept for its url (a restarted worker finds what it wrote), still one tier
    assert list(index.shared) == ["tier-10"]
    index.apply("http://w1", _tier_batch(1, "tier-11", []) | {"worker_id": "w1-restarted"})
    assert "tier-10" not in index.shared and "tier-10" not in index._shared_max


def test_a_redis_tier_stays_while_another_worker_names_it():
    index = PrefixIndex(clock=Clock())
    kept = _hashes(10)
    index.apply("http://w1", _tier_batch(1, "tier-1", kept))
    index.apply("http://w2", _tier_batch(1, "tier-1", [], worker_id="w2"))
    index.drop("http://w1")
    assert index.match("http://w2", [bytes.fromhex(kept[0])], ["t-a"]).num_blocks == 1
    index.apply("http://w2", _tier_batch(2, "tier-2", [], worker_id="w2"))  # w2 moved to another Redis
    assert "tier-1" in index.shared  # still held for w1's url
    index.apply("http://w1", _tier_batch(1, "tier-2", [], worker_id="w1-restarted"))  # and w1 too
    assert list(index.shared) == [] and "tier-1" not in index._shared_max


def test_a_reported_redis_ttl_is_clamped():
    clock = Clock()
    index = PrefixIndex(clock=clock, max_remote_ttl_s=600.0)
    index.apply("http://w1", _tier_batch(1, "tier-1", _hashes(100), ttl_s=1e9))
    clock.now += 601  # before: kept for 1e9 s, as the worker said
    index.apply("http://w1", _tier_batch(2, "tier-1", []))
    assert "tier-1" not in index.shared
    for tier_id, ttl_s in ((["x"], TTL_S), ("x" * 129, TTL_S), ("tier-1", float("nan")), ("tier-1", -1.0)):
        with pytest.raises(ValueError):  # a malformed batch: the consumer drops the worker
            PrefixIndex().apply("http://w1", _tier_batch(1, tier_id, _hashes(1), ttl_s=ttl_s))
