"""Entries of another codec, block shape or dtype in the disk and Redis tiers (same model fingerprint).

An operator may change ``--l3-codec`` / ``--remote-codec`` across a restart, or workers of one model may
run with different codecs against one Redis: an entry is decoded with the codec its header names. An entry
whose dtype or block shape differs from this worker's is a miss and is deleted, never decoded wrongly,
raised out of the tier, kept alive (Redis TTL) or announced to the router.
"""

import redis
import torch

from policies.hashing import block_hashes
from tests.worker.conftest import prompt_of, segments
from worker.kv_events import KVEventLog, TierEvents
from worker.tiers.disk import DiskTier
from worker.tiers.entry import BlockRecord
from worker.tiers.host import DemotedBlock
from worker.tiers.remote import RemoteTier

SHAPE = (2, 2, 16, 2, 16)  # random-tiny's block
OTHER_SHAPE = (2, 2, 16, 1, 32)  # as many values, another layout
FP = b"\x42" * 32


def _blocks(n: int = 3, shape: tuple[int, ...] = SHAPE) -> list[DemotedBlock]:
    tokens = prompt_of(5, 16 * n)
    out, parent = [], None
    for k, h in enumerate(block_hashes(tokens, 16, FP, segments(b"key-of-tenant-a!" * 2, "t-a"))):
        rec = BlockRecord(block_hash=h, parent_hash=parent, token_ids=tuple(tokens[16 * k : 16 * (k + 1)]))
        out.append(DemotedBlock(record=rec, namespace_id="t-a", position=k, data=torch.randn(shape)))
        parent = h
    return out


def _remote(url: str, codec: str, shape=SHAPE, dtype=torch.float32, events=None) -> RemoteTier:
    return RemoteTier(
        url,
        fingerprint=FP,
        codec=codec,
        block_shape=shape,
        dtype=dtype,
        budget_bytes=1 << 24,
        ttl_s=60.0,
        timeout_s=2.0,
        events=events,
    )


def _get_run(tier: RemoteTier, blocks: list[DemotedBlock]):
    return tier.get_run(
        ["t-a"] * len(blocks), [b.record.block_hash for b in blocks], [b.record.token_ids for b in blocks]
    )


def test_a_redis_entry_of_another_codec_is_decoded_with_its_own(kv_redis_url):
    blocks = _blocks()
    assert _remote(kv_redis_url, "fp8").put(blocks) == 3
    records, data = _get_run(_remote(kv_redis_url, "none"), blocks)
    assert len(records) == 3
    expected = torch.stack([b.data for b in blocks])
    assert ((data - expected).norm() / expected.norm()).item() < 0.04  # fp8's error, not garbage


def test_a_redis_run_written_in_several_codecs_is_decoded_whole(kv_redis_url):
    blocks = _blocks(4)
    _remote(kv_redis_url, "fp8").put(blocks[:2])
    _remote(kv_redis_url, "int4").put(blocks[2:3])
    _remote(kv_redis_url, "none").put(blocks[3:])
    records, data = _get_run(_remote(kv_redis_url, "fp8"), blocks)
    assert records == [b.record for b in blocks]
    for k, bound in enumerate([0.04, 0.04, 0.12, 0.0]):
        error = ((data[k] - blocks[k].data).norm() / blocks[k].data.norm()).item()
        assert error <= bound, (k, error)


def test_a_redis_entry_of_another_block_layout_is_a_miss_deleted_unannounced(kv_redis_url):
    blocks = _blocks(shape=OTHER_SHAPE)
    assert _remote(kv_redis_url, "none", shape=OTHER_SHAPE).put(blocks) == 3
    log = KVEventLog(64)
    reader = _remote(kv_redis_url, "none", events=TierEvents(log, "remote"))
    client = redis.Redis.from_url(kv_redis_url)
    first_key = reader.key("t-a", blocks[0].record.block_hash)
    client.pexpire(first_key, 5_000)
    assert _get_run(reader, blocks) == ([], None)
    assert not client.exists(first_key), "an unreadable entry was left in Redis"
    assert [e.kind for e in log.since(0, max_events=100).events] == ["BlockRemoved"]
    assert reader.counters["corrupt_deleted_total"] == 1


def test_a_redis_run_stops_at_the_first_entry_of_another_dtype(kv_redis_url):
    blocks = _blocks()
    assert _remote(kv_redis_url, "none").put(blocks[:2]) == 2
    half = [
        DemotedBlock(record=b.record, namespace_id="t-a", position=2, data=b.data.half()) for b in blocks[2:]
    ]
    assert _remote(kv_redis_url, "none", dtype=torch.float16).put(half) == 1
    records, data = _get_run(_remote(kv_redis_url, "none"), blocks)
    assert records == [b.record for b in blocks[:2]]
    assert torch.equal(data, torch.stack([b.data for b in blocks[:2]]))


def _disk(root, codec: str, shape=SHAPE, events=None) -> DiskTier:
    return DiskTier(
        root,
        budget_bytes=1 << 24,
        fingerprint=FP,
        codec=codec,
        block_shape=shape,
        dtype=torch.float32,
        min_free_bytes=0,
        events=events,
    )


def test_disk_files_of_another_codec_are_read_after_a_restart(tmp_path):
    blocks = _blocks()
    first = _disk(tmp_path, "fp8")
    assert first.write(blocks) == 3
    first.close()  # the worker stopped
    restarted = _disk(tmp_path, "none")  # the operator switched to --l3-codec none
    found = restarted.match([b.record.block_hash for b in blocks], [b.record.token_ids for b in blocks])
    assert len(found) == 3
    records, data = restarted.read(found[0][0], 0, 3)
    assert records == [b.record for b in blocks]
    expected = torch.stack([b.data for b in blocks])
    assert ((data - expected).norm() / expected.norm()).item() < 0.04


def test_disk_files_of_another_block_layout_are_deleted_at_start_and_not_announced(tmp_path):
    first = _disk(tmp_path, "none", shape=OTHER_SHAPE)
    assert first.write(_blocks(shape=OTHER_SHAPE)) == 3
    first.close()
    log = KVEventLog(64)
    restarted = _disk(tmp_path, "none", events=TierEvents(log, "L3"))
    assert restarted.stats()["files"] == 0 and restarted.counters["corrupt_deleted_total"] == 1
    assert not list(tmp_path.rglob("*.kv"))
    assert not log.since(0, max_events=100).events
