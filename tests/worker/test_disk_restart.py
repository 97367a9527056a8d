"""The disk tier's file links and byte budget after a restart, whatever order the files are scanned in.

Files are named after their first block's hash, so a scan meets a chain's files in random order; a child
met before its parent used to go uncounted, leaving the parent's child count at -1 once the child went:
never evictable again, and the tier then wrote past its budget."""

import torch

from policies.hashing import block_hashes
from tests.worker.conftest import segments
from worker.tiers.disk import DiskTier
from worker.tiers.entry import BlockRecord, encode_entry
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
    first.close()  # the worker stopped
    restarted = _tier(tmp_path, 1 << 24)
    counts = {info.records[0].block_hash: info.num_child_files for info in restarted.files.values()}
    assert counts == {chain[0].record.block_hash: 1, chain[2].record.block_hash: 0}


def test_the_parent_of_an_evicted_child_is_evictable_after_restart(tmp_path):
    (chain,) = _chains_scanned_child_first(1)
    first = _tier(tmp_path, 1 << 24)
    first.write(chain)
    first.close()
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
    first.close()
    budget = 4 * _file_bytes(tmp_path)
    tier = _tier(tmp_path, budget)  # restarted with a smaller budget than the files it finds
    assert tier.num_bytes <= budget
    for seed in range(1000, 1030):
        tier.write(_chain(seed, 2))
        assert tier.num_bytes <= budget


def test_a_write_that_finds_no_room_is_refused_not_written_past_the_budget(tmp_path):
    file_bytes = _file_bytes(tmp_path)  # of a two-block file; a one-block file is about half of it
    budget = 7 * file_bytes // 5
    tier = _tier(tmp_path / "kv", budget)
    tier.set_reservation("t-d1", 4 * file_bytes)  # a dedicated owner: granted the disk's reservable half
    assert tier.reserved_bytes == {"t-d1": budget // 2}
    assert tier.write(_chain(1, 1, "t-d1")) == 1  # one file, within its reservation
    # Another owner's two-block file fits only by evicting that file: refused.
    assert tier.write(_chain(3, 2, "t-x")) == 0
    assert tier.num_bytes <= budget and tier.stats()["no_room_total"] == 1


def _long_chain(count: int, block_size: int) -> list[DemotedBlock]:
    """Blocks of ``block_size`` tokens with 6-digit ids (a 151k-token vocabulary): a long header per file."""
    tokens = [100_000 + (i * 7919) % 50_000 for i in range(block_size * count)]
    hashes = block_hashes(tokens, block_size, FP, segments(b"key-of-tenant-a!" * 2, "t-a"))
    shape = (1, 2, block_size, 1, 2)  # a tiny payload: the header is the point
    return [
        DemotedBlock(
            record=BlockRecord(
                block_hash=h,
                parent_hash=hashes[k - 1] if k else None,
                token_ids=tuple(tokens[block_size * k : block_size * (k + 1)]),
            ),
            namespace_id="t-a",
            position=k,
            data=torch.full(shape, float(k)),
        )
        for k, h in enumerate(hashes)
    ]


def test_a_file_whose_header_is_larger_than_64_kib_survives_a_restart(tmp_path):
    def tier() -> DiskTier:
        return DiskTier(
            tmp_path,
            budget_bytes=1 << 30,
            fingerprint=FP,
            codec="none",
            block_shape=(1, 2, 320, 1, 2),
            dtype=torch.float32,
            min_free_bytes=0,
        )

    first = tier()
    assert first.write(_long_chain(32, 320)) == 32 and first.stats()["files"] == 1  # a 32-block file
    first.close()
    restarted = tier()
    stats = restarted.stats()
    assert stats.get("corrupt_deleted_total", 0) == 0, stats  # before: "truncated entry header", deleted
    assert stats["blocks"] == 32 and restarted.index == first.index


def test_a_file_whose_header_claims_more_than_the_file_holds_is_deleted(tmp_path):
    first = _tier(tmp_path, 1 << 24)
    first.write(_chain(1, 2))
    (path,) = [info.path for info in first.files.values()]
    data = bytearray(path.read_bytes())
    data[6:10] = (len(data) + 1).to_bytes(4, "little")  # the header length in the fixed prefix
    path.write_bytes(data)
    first.close()
    restarted = _tier(tmp_path, 1 << 24)
    assert restarted.stats()["corrupt_deleted_total"] == 1 and not path.exists()


def test_a_file_listing_no_blocks_is_deleted_not_fatal(tmp_path):
    first = _tier(tmp_path, 1 << 24)
    first.write(_chain(1, 2))
    empty = encode_entry(
        fingerprint=FP,
        namespace_id="t-a",
        codec="none",
        dtype="float32",
        block_shape=SHAPE,
        blocks=[],
        payloads=[],
    )  # a valid checksum over a header that lists no block
    path = first.dir / "t-a" / f"{'0' * 64}.kv"
    path.write_bytes(empty)
    first.close()
    restarted = _tier(tmp_path, 1 << 24)  # before: IndexError in _parents_first, the worker never started
    assert restarted.stats()["corrupt_deleted_total"] == 1 and not path.exists()
    assert restarted.index == first.index
