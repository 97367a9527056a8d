"""The disk tier's file bookkeeping under duplicates, races and an unusable directory (review r16).

A clean stop's flush hands the disk L1's blocks and L2's copies of the same blocks (a prefix loaded back
from L2 is in both): the second copy was a second run of the same name, renamed over the first file, then
unlinked as a duplicate, so the file the index listed was gone and the prefix was lost at restart."""

import logging
import os

import pytest

from tests.worker.conftest import prompt_of, run
from tests.worker.test_disk_restart import _chain, _tier
from tests.worker.test_tiers import BLOCK_BYTES, A, push_out_of_l1
from worker.metrics import PREFIX, EngineCollector
from worker.tiers.entry import CorruptEntry
from worker.tiers.host import DemotedBlock


def _copies(blocks: list[DemotedBlock]) -> list[DemotedBlock]:
    return [
        DemotedBlock(record=b.record, namespace_id=b.namespace_id, position=b.position, data=b.data.clone())
        for b in blocks
    ]


def test_a_chain_given_twice_in_one_write_is_written_once_and_kept(tmp_path):
    tier = _tier(tmp_path, 1 << 24)
    chain = _chain(1, 4)
    assert tier.write(chain + _copies(chain)) == 4  # as flush() did: L1's blocks, then L2's copies
    missing = [info.path.name for info in tier.files.values() if not info.path.exists()]
    assert len(tier.files) == 2 and not missing, f"{missing} listed but gone from disk"
    assert tier.counters["blocks_written_total"] == 4
    assert sorted(p.name for p in tmp_path.rglob("*.kv")) == sorted(i.path.name for i in tier.files.values())
    for file_id, info in tier.files.items():
        records, _ = tier.read(file_id, 0, len(info.records))
        assert records == list(info.records)


async def test_a_prefix_loaded_back_from_l2_survives_a_clean_restart(make_engine, tmp_path):
    settings = dict(num_blocks=24, l2_bytes=64 * BLOCK_BYTES, l3_dir=tmp_path, l3_min_free_bytes=0)
    engine = make_engine(**settings)
    prompt = prompt_of(1, 80)
    await run(engine, "first", prompt, segs=A)
    await push_out_of_l1(engine)
    _, usage, _ = await run(engine, "again", prompt, segs=A)
    assert usage["cached_tokens_by_source"]["l2"] == 64  # back in L1, still in L2
    engine.store.wait_for_writes()
    engine.stop()  # a clean stop flushes L1 and L2 to disk
    restarted = make_engine(**settings)
    _, usage, _ = await run(restarted, "after-restart", prompt, segs=A)
    assert usage["cached_tokens_by_source"].get("l3", 0) == 64, usage


def test_a_read_that_loses_the_race_with_an_eviction_is_a_miss_not_damage(tmp_path, caplog):
    tier = _tier(tmp_path, 1 << 24)
    tier.write(_chain(3, 2))
    ((file_id, info),) = tier.files.items()

    class EvictedOnOpen(type(info.path)):
        def open(self, *args, **kwargs):
            with tier._lock:  # the writer's eviction runs between the reader's look-up and its open
                tier._drop(file_id)
            return super().open(*args, **kwargs)

    info.path = EvictedOnOpen(info.path)
    with caplog.at_level(logging.WARNING, "prefixgate.worker.disk"), pytest.raises(CorruptEntry):
        tier.read(file_id, 0, 2)
    assert tier.counters["corrupt_deleted_total"] == 0 and tier.counters["reads_evicted_total"] == 1
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def _unusable_dirs(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    yield "under-a-file", blocker / "kv"
    if os.geteuid() != 0:  # root writes into a read-only mode anyway
        read_only = tmp_path / "read-only"
        read_only.mkdir(mode=0o500)
        yield "read-only", read_only / "kv"


async def test_an_unusable_l3_dir_runs_without_l3_with_a_warning_and_a_metric(make_engine, tmp_path, caplog):
    for name, l3_dir in _unusable_dirs(tmp_path):
        caplog.clear()
        with caplog.at_level(logging.WARNING, "prefixgate.worker.tiers"):
            engine = make_engine(l3_dir=l3_dir, l3_min_free_bytes=0)
        assert engine.store.disk is None, name
        assert any("without the L3 disk tier" in r.getMessage() for r in caplog.records), name
        samples = {
            (s.name, tuple(s.labels.values())): s.value
            for family in EngineCollector(engine.stats).collect()
            for s in family.samples
        }
        assert samples[(PREFIX + "tier_accepting", ("l3",))] == 0
        assert samples[(PREFIX + "tier_events_total", ("l3", "open_failed"))] == 1
        _, usage, _ = await run(engine, f"served-{name}", prompt_of(4, 40), segs=A)
        assert usage["prompt_tokens"] == 40
