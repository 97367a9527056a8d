"""Belady's MIN: optimal on small streams (checked by exhaustive search), an upper bound on policies."""

import functools
import random

import pytest

from bench.belady import next_use_keys, replay_belady
from bench.isolation import partitions
from bench.replay import ReplayRequest, replay
from bench.workloads import WorkloadSpec, generate_workload
from policies.eviction import POLICIES, BlockId, make_policy


def _chained_stream(rng: random.Random, num_requests: int) -> list[ReplayRequest]:
    node_ids: dict[tuple[int, int], BlockId] = {}
    stream = []
    for index in range(num_requests):
        parent, chain = -1, []
        for _ in range(rng.randint(1, 3)):
            parent = node_ids.setdefault((parent, rng.randint(0, 1)), BlockId(len(node_ids)))
            chain.append(parent)
        stream.append(ReplayRequest(now_s=float(index), block_ids=tuple(chain)))
    return stream


def _best_possible_hits(stream: list[ReplayRequest], capacity: int) -> int:
    """Exhaustive search over every admit / bypass / victim choice."""
    accesses = tuple(b for r in stream for b in r.block_ids)

    @functools.cache
    def best(index: int, cache: frozenset) -> int:
        if index == len(accesses):
            return 0
        block_id = accesses[index]
        if block_id in cache:
            return 1 + best(index + 1, cache)
        options = [best(index + 1, cache)]  # bypass
        if len(cache) < capacity:
            options.append(best(index + 1, cache | {block_id}))
        else:
            options += [best(index + 1, (cache - {victim}) | {block_id}) for victim in cache]
        return max(options)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(12))
def test_min_is_optimal_on_small_streams(seed):
    rng = random.Random(seed)
    stream = _chained_stream(rng, 6)
    capacity = rng.randint(1, 3)
    counts = replay_belady(stream, capacity)
    assert counts.num_hits == _best_possible_hits(stream, capacity)
    assert counts.num_prefix_hits == counts.num_hits  # its cache stays parent-closed


def test_next_use_orders_parents_before_children():
    stream = [ReplayRequest(now_s=0.0, block_ids=(BlockId(1), BlockId(2))) for _ in range(2)]
    keys = next_use_keys(stream)
    assert keys[0][0] < keys[0][1]  # both are next used by request 1, the parent first
    assert keys[1][0] < keys[1][1]  # never used again: still parent first
    assert keys[1][0] > keys[0][1]


@pytest.mark.parametrize("mode", ["prefix", "flat"])
def test_min_bounds_every_policy(mode):
    requests = generate_workload(WorkloadSpec(num_requests=600, seed=3))
    for capacity in (50, 400):
        (part,) = partitions(requests, "shared", capacity)
        bound = replay_belady(part.requests, capacity)
        for name in POLICIES:
            counts = replay(part.requests, make_policy(name, capacity), capacity, mode=mode)
            assert counts.num_hits <= bound.num_hits, (name, capacity)
            assert counts.num_prefix_hits <= bound.num_prefix_hits, (name, capacity)
