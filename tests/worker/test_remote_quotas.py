"""Dedicated owners' Redis quotas are granted from every worker's requests, not each worker's own.

Each worker used to share half the Redis budget among the dedicated tenants *it* had seen: two workers
serving different dedicated tenants granted each of them the whole half, and with the shared LRU's half
on top the Redis held 1.5 times its budget."""

import time

from tests.worker.test_tiers import _demoted

BUDGET = 40 * 9000  # ~40 entries of random-tiny's block (8 KiB payload and a header)
FP = b"quotas-2-workers" * 2


def _worker(url: str, **kw):
    import torch

    from worker.tiers.remote import RemoteTier

    return RemoteTier(
        url,
        fingerprint=FP,
        codec="none",
        block_shape=(2, 2, 16, 2, 16),
        dtype=torch.float32,
        budget_bytes=BUDGET,
        ttl_s=60,
        timeout_s=1.0,
        **kw,
    )


def _held_bytes(tier, namespaces) -> int:
    books = [tier._total, *(tier._partition(ns)[2] for ns in namespaces)]
    return sum(int(tier.client.get(key) or 0) for key in books)


def test_two_workers_granting_different_dedicated_tenants_share_one_half_of_the_budget(kv_redis_url):
    first, second = _worker(kv_redis_url), _worker(kv_redis_url)
    first.set_reservation("t-x", BUDGET)  # each worker serves one dedicated tenant asking for everything
    second.set_reservation("t-y", BUDGET)
    first.put([_demoted("t-x", 0)])
    second.put([_demoted("t-y", 1000)])
    time.sleep(1.2)  # each worker reads the others' requests at least once a second while it writes
    for i in range(1, 80):
        first.put([_demoted("t-x", i), _demoted("t-s", 2000 + i)])
        second.put([_demoted("t-y", 1000 + i), _demoted("t-s", 3000 + i)])
    held = _held_bytes(first, ["t-x", "t-y"])
    assert held <= BUDGET, f"{held / BUDGET:.2f} times the budget"  # before: 1.5 times
    assert first._quotas == second._quotas == {"t-x": BUDGET // 4, "t-y": BUDGET // 4}


def test_a_gone_workers_requests_lapse_and_its_owners_partition_is_trimmed(kv_redis_url):
    gone = _worker(kv_redis_url, reservation_lease_s=1.0)
    gone.set_reservation("t-x", BUDGET)
    gone.put([_demoted("t-x", i) for i in range(10)])
    live = _worker(kv_redis_url, reservation_lease_s=1.0)
    live.set_reservation("t-y", BUDGET)
    live.put([_demoted("t-y", 1000)])
    assert live._quotas == {"t-x": BUDGET // 4, "t-y": BUDGET // 4}
    time.sleep(1.5)  # "gone" writes nothing more and its writer thread is not running: its lease lapses
    live.put([_demoted("t-y", 1001)])
    assert live._quotas == {"t-y": BUDGET // 2}
    live.put([_demoted("t-y", 1002)])  # the lapsed owner's partition was trimmed (emptied) on the way
    assert int(live.client.get(live._partition("t-x")[2]) or 0) == 0
    live.set_reservation("t-y", 0)  # a released request leaves the table with the next sync
    live.put([_demoted("t-s", 7)])
    assert not live.client.hlen(live.requests.keys[0]) and live._quotas == {}


def test_a_partition_left_by_a_dead_worker_is_emptied_by_a_worker_that_never_saw_it(kv_redis_url):
    gone = _worker(kv_redis_url, reservation_lease_s=1.0)
    gone.set_reservation("t-x", BUDGET)  # alone: its quota is half the budget
    gone.put([_demoted("t-x", i) for i in range(40)])
    assert int(gone.client.get(gone._partition("t-x")[2]) or 0) > BUDGET // 3
    del gone  # killed (SIGKILL, OOM): nobody releases t-x's request, and its lease lapses
    time.sleep(1.5)
    fresh = _worker(kv_redis_url, reservation_lease_s=1.0)  # a restart: it never heard of t-x
    for i in range(60):
        fresh.put([_demoted("t-s", 5000 + i)])  # ordinary tenants fill the shared LRU, now the whole budget
    # Before: t-x's partition stayed full until its keys' TTL: the Redis held ~1.5 times its budget.
    assert _held_bytes(fresh, ["t-x"]) <= BUDGET
    assert int(fresh.client.get(fresh._partition("t-x")[2]) or 0) == 0
    time.sleep(1.1)
    fresh.put([_demoted("t-s", 6000)])  # the next sync forgets the emptied partition: its books and mark
    assert not fresh.client.exists(*fresh._partition("t-x"))
    assert not fresh.client.sismember(fresh.requests.keys[2], "t-x")


async def test_two_engines_serving_different_dedicated_tenants_agree_on_the_quotas(make_engine, kv_redis_url):
    from tests.worker.conftest import greedy, prompt_of, run
    from tests.worker.test_engine_reservations import seg

    per_block = make_engine(num_blocks=64).store.bytes_per_block
    first, second = (
        make_engine(
            num_blocks=24, l2_bytes=4 * per_block, remote_url=kv_redis_url, remote_bytes=40 * per_block
        )
        for _ in range(2)
    )

    async def traffic(engine, ns: str, seed: int, count: int) -> None:
        for i in range(count):  # new prompts: older blocks go down L1 -> L2 -> Redis (writes sync the quotas)
            await run(
                engine,
                f"{ns}-{seed}-{i}",
                prompt_of(seed + i, 80),
                params=greedy(2),
                segs=seg(ns, ns.encode() * 8, 20),
            )
        engine.store.wait_for_writes()

    await traffic(first, "t-x", 100, 8)
    await traffic(second, "t-y", 200, 8)
    time.sleep(1.2)  # each worker reads the others' requests at least once a second while it writes
    await traffic(first, "t-x", 300, 8)
    await traffic(second, "t-y", 400, 8)
    quarter = first.store.remote.budget_bytes // 4
    assert (
        first.store.remote.counters["blocks_written_total"]
        and second.store.remote.counters["blocks_written_total"]
    )
    # Before: each engine granted its own tenant the whole reservable half (and kept a half for the rest).
    assert first.store.remote._quotas == second.store.remote._quotas == {"t-x": quarter, "t-y": quarter}
