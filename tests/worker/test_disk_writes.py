"""The disk tier's file bookkeeping under duplicates (review r16).

A clean stop's flush hands the disk L1's blocks and L2's copies of the same blocks (a prefix loaded back
from L2 is in both): the second copy was a second run of the same name, renamed over the first file, then
unlinked as a duplicate, so the file the index listed was gone and the prefix was lost at restart."""

from tests.worker.conftest import prompt_of, run
from tests.worker.test_disk_restart import _chain, _tier
from tests.worker.test_tiers import BLOCK_BYTES, A, push_out_of_l1
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
