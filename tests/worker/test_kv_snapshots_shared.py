"""Snapshots under contention: more consumers than ``MAX_SNAPSHOTS`` paging at once, and callers sending
unknown cursors, must never evict a snapshot someone is paging (they used to, so nobody finished)."""

import pytest

from policies.hashing import BlockHash
from worker import kv_events
from worker.kv_events import MAX_SNAPSHOTS, SNAPSHOT_ACTIVE_S, KVEventLog


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(2, "big") * 16)


def disk_log(num_blocks: int = 40) -> KVEventLog:
    """A log whose ring (4 events) lost most of ``num_blocks`` stored blocks: consumers from 0 need
    the snapshot."""
    log = KVEventLog(capacity_events=4)
    for i in range(num_blocks):
        log.stored("L3", h(i), None, "ns")
    return log


def page_all(log: KVEventLog, cursors: list[str | None], rounds: int, max_events: int = 8) -> list[int]:
    """Page every consumer round-robin; the number of snapshots each one was (re)started with."""
    starts = [0] * len(cursors)
    finished = [False] * len(cursors)
    for _ in range(rounds):
        for c, cursor in enumerate(cursors):
            if finished[c]:
                continue
            batch = log.read(0, cursor=cursor, max_events=max_events)
            assert batch.snapshot is not None
            starts[c] += batch.reset
            cursors[c] = batch.snapshot.next_cursor
            finished[c] = cursors[c] is None
    assert all(finished), f"unfinished consumers after {rounds} rounds: {finished}"
    return starts


def test_more_consumers_than_snapshots_all_finish_sharing_one_snapshot():
    log = disk_log()
    assert page_all(log, [None] * (MAX_SNAPSHOTS + 1), rounds=100) == [1] * (MAX_SNAPSHOTS + 1)
    assert not log._snapshots  # every reader read its last page: dropped


def test_unknown_cursors_never_restart_a_consumer_paging_its_snapshot():
    log = disk_log()
    cursor = log.read(0, max_events=8).snapshot.next_cursor
    restarts, blocks = 0, 8
    while cursor is not None:
        for _ in range(MAX_SNAPSHOTS):  # another caller (a replica, a bogus client) with garbage cursors
            assert log.read(0, cursor="deadbeef:0", max_events=8).reset
        batch = log.read(0, cursor=cursor, max_events=8)
        restarts += batch.reset
        blocks += sum(len(e["block_hashes"]) for e in batch.snapshot.events)
        cursor = batch.snapshot.next_cursor
        assert restarts == 0
    assert blocks == 40


def test_at_the_cap_an_active_snapshot_is_shared_not_evicted_and_an_idle_one_is_evicted(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(kv_events.time, "monotonic", lambda: now[0])
    log = disk_log()
    cursors: list[str | None] = []
    for i in range(MAX_SNAPSHOTS):  # one event between starts: each consumer needs a snapshot of its own
        first = log.read(0, max_events=8)
        assert first.reset and first.snapshot.seq == log.last_seq
        cursors.append(first.snapshot.next_cursor)
        log.stored("L3", h(100 + i), None, "ns")
    assert len({c.partition(":")[0] for c in cursors}) == MAX_SNAPSHOTS
    # The cap is reached and all are in use: the next consumer shares the newest (an older state; it
    # continues with the events after it), nobody is evicted, and everyone finishes without a restart.
    late = log.read(0, max_events=8)
    assert late.reset and late.snapshot.seq == log.last_seq - 1
    assert late.snapshot.next_cursor.partition(":")[0] == cursors[-1].partition(":")[0]
    assert page_all(log, [*cursors, late.snapshot.next_cursor], rounds=10) == [0] * (MAX_SNAPSHOTS + 1)
    # Snapshots left unread (abandoned by their consumers) make room once idle.
    for i in range(MAX_SNAPSHOTS):
        log.read(0, max_events=8)
        log.stored("L3", h(200 + i), None, "ns")
    now[0] += SNAPSHOT_ACTIVE_S + 1
    fresh = log.read(0, max_events=8)
    assert fresh.reset and fresh.snapshot.seq == log.last_seq
    assert len(log._snapshots) == MAX_SNAPSHOTS


@pytest.mark.parametrize("num_consumers", [2, MAX_SNAPSHOTS + 3])
def test_shared_snapshot_pages_are_identical_for_every_consumer(num_consumers):
    log = disk_log(20)
    pages: list[list[str]] = [[] for _ in range(num_consumers)]
    cursors: list[str | None] = [None] * num_consumers
    for _ in range(100):  # 4 pages each; bounded so that a livelock fails instead of hanging
        for c in range(num_consumers):
            if cursors[c] is None and pages[c]:
                continue
            batch = log.read(0, cursor=cursors[c], max_events=6)
            pages[c] += [x for e in batch.snapshot.events for x in e["block_hashes"]]
            cursors[c] = batch.snapshot.next_cursor
        if all(c is None for c in cursors):
            break
    assert all(c is None for c in cursors)
    assert all(p == [h(i).hex() for i in range(20)] for p in pages)
