"""Hostile namespace ids at the tiers: a long id, glob characters, an id shaped like the tier's own keys.

The worker API refuses such ids (tests/worker/test_server.py); the tiers defend themselves too, since they
name directories and Redis keys after the id.
"""

import torch

from policies.hashing import block_hashes
from tests.worker.conftest import prompt_of, segments
from tests.worker.test_tiers import _demoted, _remote_tier
from worker.tiers.disk import DiskTier
from worker.tiers.entry import BlockRecord
from worker.tiers.host import DemotedBlock

SHAPE = (2, 2, 16, 2, 16)  # random-tiny's block
FP = b"\x42" * 32


def _chain(namespace_id: str, seed: int, n: int = 2) -> list[DemotedBlock]:
    tokens = prompt_of(seed, 16 * n)
    segs = segments(b"key-of-some-tenant" * 2, namespace_id)
    out, parent = [], None
    for k, h in enumerate(block_hashes(tokens, 16, FP, segs)):
        rec = BlockRecord(block_hash=h, parent_hash=parent, token_ids=tuple(tokens[16 * k : 16 * (k + 1)]))
        out.append(DemotedBlock(record=rec, namespace_id=namespace_id, position=k, data=torch.randn(SHAPE)))
        parent = h
    return out


def test_a_long_namespace_id_does_not_stop_the_disk_tier_for_everyone(tmp_path):
    disk = DiskTier(
        tmp_path,
        budget_bytes=1 << 24,
        fingerprint=FP,
        codec="none",
        block_shape=SHAPE,
        dtype=torch.float32,
        min_free_bytes=0,
    )
    long_id = "x" * 300  # longer than a file name may be (255 bytes)
    assert disk.write(_chain(long_id, 1)) == 2
    assert disk.write(_chain("t-a", 2)) == 2
    stats = disk.stats()
    assert stats["accepting"] == 1 and stats.get("write_errors_total", 0) == 0
    assert stats["files"] == 2
    assert disk.purge(long_id) == 2
    assert disk.stats()["files"] == 1 and len(list(disk.dir.glob("*/"))) == 1  # the long id's dir is gone


def test_redis_purge_erases_exactly_one_namespace_whatever_its_id(kv_redis_url):
    tier = _remote_tier(kv_redis_url, b"purge-glob-test!" * 2, budget_bytes=1 << 30)
    tier.set_reservation("t-q", 1 << 20)  # its bookkeeping keys live under "<prefix>:~quota:t-q:…"
    names = ["t-a", "t-b", "t-q", "t-a:b"]
    for k, ns in enumerate(names):
        tier.put([_demoted(ns, 10 * k + i) for i in range(3)])
    total_before = int(tier.client.get(tier._total))
    for hostile in ["*", "t-?", "t-[ab]", "t-a\\", "~quota", "~quota:t-q", "t-"]:
        assert tier.purge(hostile) == 0, hostile
    for k, ns in enumerate(names):
        assert len(_held_keys(tier, ns, range(10 * k, 10 * k + 3))) == 3, ns
    assert int(tier.client.get(tier._total)) == total_before
    assert tier.client.exists(f"{tier.prefix}:~quota:t-q:lru")
    assert tier.purge("t-a") == 3  # and not t-a:b's blocks
    assert len(_held_keys(tier, "t-a:b", range(30, 33))) == 3


def _held_keys(tier, ns: str, ids: range) -> list[str]:
    keys = [tier.key(ns, _demoted(ns, i).record.block_hash) for i in ids]
    return [k for k in keys if tier.client.exists(k)]
