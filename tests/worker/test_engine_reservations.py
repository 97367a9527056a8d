"""Dedicated tenants' block reservations on a real engine: the reserved capacity (half of each tier) is
shared fairly between the namespaces that ask (max-min), a namespace's reservation goes when its requests
stop asking for one or when it is purged, and every tier below L1 follows the device pool's grants."""

from policies.hashing import NamespaceSegment
from tests.worker.conftest import greedy, prompt_of, run

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
