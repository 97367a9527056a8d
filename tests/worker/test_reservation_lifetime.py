"""A dedicated tenant's reservation over time, on a real engine: kept across a restart (its files on disk
stay protected before its first request), released once its owner has sent nothing for
``--reservation-idle-s`` (an idle tenant no longer shrinks everyone else's share until a restart)."""

import asyncio
import json
import time

import pytest

from tests.worker.conftest import greedy, prompt_of, run
from tests.worker.test_engine_reservations import A, B, seg
from worker.block_manager import BlockManager
from worker.reservations import ReservationKeeper


async def test_a_dedicated_tenants_protection_survives_a_restart(make_engine, tmp_path):
    first = make_engine(num_blocks=64, l3_dir=tmp_path, l3_min_free_bytes=0)
    await run(first, "a1", prompt_of(1, 40), params=greedy(2), segs=seg("t-a", A, 8))
    per_block = first.store.disk.block_payload_bytes
    first.stop()
    restarted = make_engine(num_blocks=64, l3_dir=tmp_path, l3_min_free_bytes=0)
    # No request of t-a yet: before, nothing protected its files from the first other owner's writes.
    assert restarted.stats()["reserved_blocks"] == {"t-a": 8}
    assert restarted.store.disk.reserved_bytes == {"t-a": 8 * per_block}
    assert restarted.store.l2.index.requested_blocks == {"t-a": 8}


@pytest.mark.parametrize("release", ["left dedicated", "purged"])
async def test_a_released_reservation_is_not_restored(make_engine, tmp_path, release):
    first = make_engine(num_blocks=64, l3_dir=tmp_path, l3_min_free_bytes=0)
    await run(first, "a1", prompt_of(1, 40), params=greedy(2), segs=seg("t-a", A, 8))
    if release == "purged":
        assert not (await first.purge("t-a"))[1]
    else:  # its requests carry reserved_blocks 0
        await run(first, "a2", prompt_of(1, 40), params=greedy(2), segs=seg("t-a", A, 0))
    first.stop()
    restarted = make_engine(num_blocks=64, l3_dir=tmp_path, l3_min_free_bytes=0)
    assert restarted.stats()["reserved_blocks"] == {}


async def test_an_idle_dedicated_tenant_gives_its_share_back(make_engine, tmp_path):
    engine = make_engine(num_blocks=64, l3_dir=tmp_path, l3_min_free_bytes=0, reservation_idle_s=1.0)
    await run(engine, "a1", prompt_of(1, 40), params=greedy(2), segs=seg("t-a", A, 32))
    await run(engine, "b1", prompt_of(2, 40), params=greedy(2), segs=seg("t-b", B, 32))
    assert engine.stats()["reserved_blocks"] == {"t-a": 16, "t-b": 16}
    for i in range(6):  # only B keeps sending requests
        await asyncio.sleep(0.3)
        await run(engine, f"b{i + 2}", prompt_of(2, 40), params=greedy(2), segs=seg("t-b", B, 32))
    assert engine.stats()["reserved_blocks"] == {"t-b": 32}  # before: A kept 16 until a restart
    assert set(engine.store.disk.reserved_bytes) == {"t-b"}
    await asyncio.sleep(1.5)  # an engine with no work at all releases an idle reservation too
    assert engine.stats()["reserved_blocks"] == {}
    await run(engine, "a2", prompt_of(1, 40), params=greedy(2), segs=seg("t-a", A, 32))
    assert engine.stats()["reserved_blocks"] == {"t-a": 32}  # asked again: granted again


@pytest.mark.parametrize(
    "entry",
    [
        '{"blocks": Infinity, "asked_at": NOW}',  # json.loads takes Infinity; int(inf) overflowed
        '{"blocks": 1e400, "asked_at": NOW}',  # 1e400 parses as inf too
        '{"blocks": 8, "asked_at": 1' + "0" * 400 + "}",  # float(10**400) overflowed
        '{"blocks": 8, "asked_at": NaN}',
        '{"blocks": -8, "asked_at": NOW}',
        '{"blocks": 8.5, "asked_at": NOW}',
        '{"blocks": true, "asked_at": NOW}',
        '{"blocks": 1' + "0" * 40 + ', "asked_at": NOW}',
        '{"blocks": 8}',
        "[8, NOW]",
    ],
)
async def test_a_hostile_reservations_file_drops_its_bad_entries_and_never_stops_start_up(
    make_engine, tmp_path, entry
):
    first = make_engine(num_blocks=64, l3_dir=tmp_path, l3_min_free_bytes=0)
    directory = first.store.disk.dir
    first.stop()
    good = '{"blocks": 8, "asked_at": NOW}'
    text = f'{{"t-bad": {entry}, "t-a": {good}}}'.replace("NOW", repr(time.time()))
    (directory / "~reservations.json").write_text(text)
    restarted = make_engine(num_blocks=64, l3_dir=tmp_path, l3_min_free_bytes=0)  # before: OverflowError
    assert restarted.stats()["reserved_blocks"] == {"t-a": 8}  # the good entry is kept, the bad one dropped


def test_one_tick_releases_every_idle_reservation_at_once_and_saves_once(tmp_path):
    now = [1000.0]
    block_manager = BlockManager(2048, 16)
    keeper = ReservationKeeper(block_manager, idle_s=60, directory=tmp_path, clock=lambda: now[0])
    for i in range(500):  # 500 dedicated owners asking together: more than the reservable half of L1
        keeper.ask(f"t-{i}", 4)
    saves, grants = [], []
    save = keeper.save
    keeper.save = lambda: (saves.append(1), save())[1]
    block_manager.on_reservations = grants.append
    now[0] += 120  # all idle: the next engine-loop tick releases them all
    keeper.tick()
    assert block_manager.requested_blocks == {} and block_manager.reserved_blocks == {}
    # Before: one rewrite of the whole file per owner, each release regranting the rest (with 2,000 owners:
    # 2,000 rewrites and 4,293 grant changes told to L2, L3 and Redis one by one, each regranting: 11.6 s
    # on the engine thread).
    assert len(saves) == 1
    # The tiers below (L2, L3, Redis) are told once, each owner's release once: each tier regrants once.
    assert len(grants) == 1 and sorted(ns for ns, _ in grants[0]) == sorted(f"t-{i}" for i in range(500))
    assert json.loads((tmp_path / "~reservations.json").read_text()) == {}
