"""Our LRU, S3-FIFO and ARC are the published ones: libCacheSim gives the same flat hit ratios.

The flat replay (``bench.replay``, mode ``flat``) mirrors libCacheSim's semantics: every block id is one
request of size 1 for a cache of ``capacity`` objects. Ours and libCacheSim's must agree within 0.002 at
every size, on a generated multi-tenant workload and on the Mooncake synthetic trace when present.
"""

from pathlib import Path

import pytest

libcachesim = pytest.importorskip("libcachesim")

from bench.isolation import partitions  # noqa: E402
from bench.replay import replay  # noqa: E402
from bench.trace import TraceRequest, load_trace, num_unique_blocks  # noqa: E402
from bench.workloads import WorkloadSpec, generate_workload  # noqa: E402
from policies.eviction import make_policy  # noqa: E402

# A copy of ../shared/traces/mooncake_synthetic_trace.jsonl, so the cross-check runs wherever CI checks out.
MOONCAKE = Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace.jsonl"
FRACTIONS = (0.01, 0.05, 0.1, 0.2)
LIBCACHESIM = {"lru": "LRU", "s3fifo": "S3FIFO", "arc": "ARC"}
TOLERANCE = 0.002


def _libcachesim_hit_ratio(name: str, requests: list[TraceRequest], capacity: int) -> float:
    cache = getattr(libcachesim, LIBCACHESIM[name])(capacity)
    access = libcachesim.Request(obj_size=1)  # one request object, re-aimed at each block
    num_hits = num_requests = 0
    for request in requests:
        for block_id in request.hash_ids:
            access.obj_id = block_id
            access.clock_time = num_requests
            num_hits += cache.get(access)
            num_requests += 1
    return num_hits / num_requests


def _ours(name: str, requests: list[TraceRequest], capacity: int) -> float:
    (part,) = partitions(requests, "shared", capacity)
    return replay(part.requests, make_policy(name, capacity), capacity, mode="flat").hit_ratio


def _traces() -> list:
    generated = generate_workload(WorkloadSpec(num_requests=1000, seed=7))
    traces = [pytest.param(generated, id="generated")]
    if MOONCAKE.exists():
        traces.append(pytest.param(load_trace(MOONCAKE), id="mooncake"))
    else:
        traces.append(pytest.param(None, id="mooncake", marks=pytest.mark.skip(reason=f"{MOONCAKE} absent")))
    return traces


@pytest.mark.parametrize("name", sorted(LIBCACHESIM))
@pytest.mark.parametrize("requests", _traces())
def test_flat_hit_ratio_matches_libcachesim(name, requests):
    num_unique = num_unique_blocks(requests)
    for fraction in FRACTIONS:
        capacity = int(fraction * num_unique)
        theirs = _libcachesim_hit_ratio(name, requests, capacity)
        ours = _ours(name, requests, capacity)
        assert abs(ours - theirs) <= TOLERANCE, (fraction, ours, theirs)
