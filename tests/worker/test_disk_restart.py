"""The disk tier's file links and byte budget after a restart, whatever order the files are scanned in.

Files are named after their first block's hash, so a scan meets a chain's files in random order; a child
met before its parent used to go uncounted, leaving the parent's child count at -1 once the child went:
never evictable again, and the tier then wrote past its budget."""

import torch

from policies.hashing import block_hashes
from tests.worker.conftest import segments
from worker.tiers.disk import DiskTier
from worker.tiers.entry import BlockRecord
from worker.tiers.host import DemotedBlock

SHAPE = (2, 2, 16, 2, 16)  # random-tiny's block
FP = b"\x42" * 32


def _chain(seed: int, n: int, namespace_id: str = "t-a") -> list[DemotedBlock]:
    tokens = [(seed * 7919 + i * 104729) % 251 for i in range(16 * n)]
    out, parent = [], None
    for k, h in enumerate(block_hashes(tokens, 16, FP, segments(b"key-of-tenant-a!" * 2, namespace_id))):
        rec = BlockRecord(block_hash=h, parent_hash=parent, token_ids=tuple(tokens[16 * k : 16 * (k + 1)]))
        out.append(DemotedBlock(record=rec, namespace_id=namespace_id, position=k, data=torch.randn(SHAPE)))
        parent = h
    return out


def _chains_scanned_child_first(count: int) -> list[list[DemotedBlock]]:
    """4-block chains (two 2-block files) whose second file's name sorts before the first's."""
    chains, seed = [], 0
    while len(chains) < count:
        chain = _chain(seed, 4)
        if chain[2].record.block_hash.hex() < chain[0].record.block_hash.hex():
            chains.append(chain)
        seed += 1
    return chains


def _tier(root, budget: int) -> DiskTier:
    return DiskTier(
        root,
        budget_bytes=budget,
        fingerprint=FP,
        codec="none",
        block_shape=SHAPE,
        dtype=torch.float32,
        min_free_bytes=0,
        max_blocks_per_file=2,
        eviction_policy="lru",
    )


def _file_bytes(root) -> int:
    """About the size of one 2-block file (headers differ by a few bytes with the token ids)."""
    probe = _tier(root / "probe", 1 << 24)
    probe.write(_chain(999, 2))
    return probe.num_bytes + 64


def test_a_child_scanned_before_its_parent_is_linked_after_restart(tmp_path):
    (chain,) = _chains_scanned_child_first(1)
    first = _tier(tmp_path, 1 << 24)
    assert first.write(chain) == 4 and len(first.files) == 2
    restarted = _tier(tmp_path, 1 << 24)
    counts = {info.records[0].block_hash: info.num_child_files for info in restarted.files.values()}
    assert counts == {chain[0].record.block_hash: 1, chain[2].record.block_hash: 0}


def test_the_parent_of_an_evicted_child_is_evictable_after_restart(tmp_path):
    (chain,) = _chains_scanned_child_first(1)
    _tier(tmp_path, 1 << 24).write(chain)
    tier = _tier(tmp_path, 4 * _file_bytes(tmp_path))
    parent_id = next(f for f, info in tier.files.items() if info.records[0] == chain[0].record)
    for seed in range(1000, 1012):  # twelve newer 2-block files through a 4-file budget
        tier.write(_chain(seed, 2))
    assert parent_id not in tier.files, "the oldest file, childless once its child went, was never evicted"
    assert all(info.num_child_files >= 0 for info in tier.files.values())


def test_the_tier_stays_within_its_budget_after_a_restart(tmp_path):
    first = _tier(tmp_path, 1 << 24)
    for chain in _chains_scanned_child_first(6):
        first.write(chain)
    budget = 4 * _file_bytes(tmp_path)
    tier = _tier(tmp_path, budget)  # restarted with a smaller budget than the files it finds
    assert tier.num_bytes <= budget
    for seed in range(1000, 1030):
        tier.write(_chain(seed, 2))
        assert tier.num_bytes <= budget


def test_a_write_that_finds_no_room_is_refused_not_written_past_the_budget(tmp_path):
    file_bytes = _file_bytes(tmp_path)
    tier = _tier(tmp_path / "kv", 4 * file_bytes)
    for owner in ("t-d1", "t-d2"):  # two dedicated owners, each holding its whole reservation
        tier.set_reservation(owner, 2 * file_bytes)
        tier.write(_chain(1 if owner == "t-d1" else 2, 4, owner))
    assert len(tier.files) == 4
    assert tier.write(_chain(3, 2, "t-x")) == 0
    assert tier.num_bytes <= 4 * file_bytes and tier.stats()["no_room_total"] == 1
