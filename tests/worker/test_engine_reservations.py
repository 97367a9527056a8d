"""Dedicated tenants' block reservations on a real engine: the reserved capacity (half of each tier) is
shared fairly between the namespaces that ask (max-min), a namespace's reservation goes when its requests
stop asking for one or when it is purged, and every tier below L1 follows the device pool's grants within
its own reservable half (the disk's and Redis's budgets are their own, not L1's)."""

import torch

from policies.hashing import NamespaceSegment, block_hashes
from tests.worker.conftest import greedy, prompt_of, run
from worker.tiers.entry import BlockRecord
from worker.tiers.host import DemotedBlock

A, B = b"key-of-tenant-a!" * 2, b"key-of-tenant-b!" * 2


def seg(ns: str, key: bytes, reserved: int) -> list[NamespaceSegment]:
    return [NamespaceSegment(start_token=0, namespace_id=ns, key=key, reserved_blocks=reserved)]


async def test_a_second_dedicated_tenant_gets_its_share_of_the_reserved_capacity(make_engine, tmp_path):
    engine = make_engine(num_blocks=64, l3_dir=tmp_path, l3_min_free_bytes=0)  # 32 blocks reservable
    # A's quota was sized for a bigger worker; before, it took all 32 and B, second, was granted 0.
    await run(engine, "a1", prompt_of(1, 40), params=greedy(2), segs=seg("t-a", A, 1000))
    assert engine.stats()["reserved_blocks"] == {"t-a": 32}
    await run(engine, "b1", prompt_of(2, 40), params=greedy(2), segs=seg("t-b", B, 8))
    assert engine.stats()["reserved_blocks"] == {"t-a": 24, "t-b": 8}
    assert engine.stats()["reserved_blocks_requested"] == {"t-a": 1000, "t-b": 8}
    store = engine.store
    assert store.l2.index.requested_blocks == {"t-a": 24, "t-b": 8}  # the lower tiers follow, A's shrunk
    per_block = store.disk.block_payload_bytes
    assert store.disk.reserved_bytes == {"t-a": 24 * per_block, "t-b": 8 * per_block}


async def test_a_reservation_is_released_when_its_owner_stops_asking(make_engine, tmp_path):
    engine = make_engine(num_blocks=64, l3_dir=tmp_path, l3_min_free_bytes=0)
    await run(engine, "a1", prompt_of(1, 40), params=greedy(2), segs=seg("t-a", A, 32))
    await run(engine, "b1", prompt_of(2, 40), params=greedy(2), segs=seg("t-b", B, 32))
    assert engine.stats()["reserved_blocks"] == {"t-a": 16, "t-b": 16}
    # A is moved to `namespace` isolation by the admin: its requests carry reserved_blocks 0.
    await run(engine, "a2", prompt_of(1, 40), params=greedy(2), segs=seg("t-a", A, 0))
    assert engine.stats()["reserved_blocks"] == {"t-b": 32}  # before: A kept 32 until a restart
    assert "t-a" not in engine.store.disk.reserved_bytes
    assert engine.store.disk.reserved_bytes["t-b"] == 32 * engine.store.disk.block_payload_bytes


async def test_a_purge_releases_the_namespace_reservation(make_engine, tmp_path):
    engine = make_engine(num_blocks=64, l3_dir=tmp_path, l3_min_free_bytes=0)
    await run(engine, "a1", prompt_of(1, 40), params=greedy(2), segs=seg("t-a", A, 32))
    await run(engine, "b1", prompt_of(2, 40), params=greedy(2), segs=seg("t-b", B, 32))
    _, failed = await engine.purge("t-a")  # what the gateway does when the tenant is deleted
    assert not failed
    assert engine.stats()["reserved_blocks"] == {"t-b": 32}
    assert set(engine.store.disk.reserved_bytes) == {"t-b"}
    assert engine.store.l2.index.requested_blocks == {"t-b": 32}


def _single_block(disk, seed: int, ns: str) -> list[DemotedBlock]:
    """One full block of ``ns`` (a one-block file once written)."""
    tokens = [(seed * 7919 + i * 104729) % 251 for i in range(16)]
    (block_hash,) = block_hashes(tokens, 16, disk.fingerprint, seg(ns, (ns.encode() * 32)[:32], 0))
    record = BlockRecord(block_hash=block_hash, parent_hash=None, token_ids=tuple(tokens))
    data = torch.randn(disk.block_shape).to(disk.dtype)
    return [DemotedBlock(record=record, namespace_id=ns, position=0, data=data)]


async def test_disk_reservations_together_stay_within_half_the_disk(make_engine, tmp_path):
    per_block = make_engine(num_blocks=64, l3_dir=tmp_path / "probe", l3_min_free_bytes=0).store.disk
    per_block = per_block.block_payload_bytes
    # L1: 64 blocks, 32 reservable; the disk holds 16 blocks (a small, legal L3 budget).
    engine = make_engine(num_blocks=64, l3_dir=tmp_path / "kv", l3_min_free_bytes=0, l3_bytes=16 * per_block)
    for i, ns in enumerate(("t-a", "t-b", "t-c")):
        await run(
            engine, f"{ns}-1", prompt_of(i + 1, 40), params=greedy(2), segs=seg(ns, ns.encode() * 8, 10)
        )
    assert engine.stats()["reserved_blocks"] == {"t-a": 10, "t-b": 10, "t-c": 10}  # 30 of L1's 32
    disk = engine.store.disk
    # Before: each min(10 blocks, half the disk) = 8 blocks, 24 blocks reserved on a 16-block disk.
    half = disk.budget_bytes // 2
    assert set(disk.reserved_bytes) == {"t-a", "t-b", "t-c"} and sum(disk.reserved_bytes.values()) == half
    assert all(half // 3 <= share <= half // 3 + 1 for share in disk.reserved_bytes.values())  # equal asks


async def test_two_dedicated_tenants_leave_half_the_disk_to_the_others(make_engine, tmp_path):
    per_block = make_engine(num_blocks=64, l3_dir=tmp_path / "probe", l3_min_free_bytes=0).store.disk
    per_block = per_block.block_payload_bytes
    engine = make_engine(num_blocks=64, l3_dir=tmp_path / "kv", l3_min_free_bytes=0, l3_bytes=24 * per_block)
    for i, ns in enumerate(("t-a", "t-b")):
        await run(
            engine, f"{ns}-1", prompt_of(i + 1, 40), params=greedy(2), segs=seg(ns, ns.encode() * 8, 16)
        )
    assert engine.stats()["reserved_blocks"] == {"t-a": 16, "t-b": 16}  # L1's reservable half, shared
    disk = engine.store.disk
    engine.store.wait_for_writes()
    for i, ns in enumerate(("t-a", "t-b")):  # each fills far more than it was granted
        for k in range(12):
            disk.write(_single_block(disk, 100 * i + k, ns))
    # Before: each was granted half of the disk, and a shared tenant's writes all found no room.
    written = sum(disk.write(_single_block(disk, 1000 + k, "global")) for k in range(6))
    assert written == 6, (dict(disk._bytes_by_ns), disk.budget_bytes, disk.reserved_bytes)
    for ns in ("t-a", "t-b"):  # and the dedicated tenants keep their (smaller) reservations
        assert disk._bytes_by_ns[ns] >= disk.reserved_bytes[ns] - disk.budget_bytes // 12


async def test_redis_quotas_stay_within_half_the_redis_budget(make_engine, kv_redis_url):
    per_block = make_engine(num_blocks=64).store.bytes_per_block
    # Redis: a budget of 8 blocks' bytes; L1: 64 blocks, 32 reservable.
    engine = make_engine(num_blocks=64, remote_url=kv_redis_url, remote_bytes=8 * per_block)
    for i, ns in enumerate(("t-a", "t-b", "t-c")):
        await run(
            engine, f"{ns}-1", prompt_of(i + 1, 40), params=greedy(2), segs=seg(ns, ns.encode() * 8, 10)
        )
    assert engine.stats()["reserved_blocks"] == {"t-a": 10, "t-b": 10, "t-c": 10}
    remote = engine.store.remote
    # Before: three partitions of ~10 blocks each on top of the 8-block shared budget (4.2x the budget).
    half = remote.budget_bytes // 2
    assert set(remote._quotas) == {"t-a", "t-b", "t-c"} and sum(remote._quotas.values()) == half
    assert all(half // 3 <= quota <= half // 3 + 1 for quota in remote._quotas.values())
    assert remote._accounting("global")[1] == remote.budget_bytes - half  # the shared LRU's limit shrank
    assert remote._accounting("t-a")[1] == half // 3
