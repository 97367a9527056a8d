"""Isolation views of a trace, quota split, and the shape shared > namespace > dedicated."""

import pytest

from bench.belady import replay_belady
from bench.isolation import partitions, split_capacity
from bench.replay import replay, total
from bench.trace import TraceRequest
from bench.workloads import WorkloadSpec, generate_workload
from policies.eviction import make_policy


def _request(tenant: str, *hash_ids: int) -> TraceRequest:
    return TraceRequest(timestamp_ms=0.0, hash_ids=hash_ids, tenant=tenant)


def test_namespaces_never_share_a_block():
    requests = [_request("a", 1, 2), _request("b", 1, 2), _request("a", 1, 3)]
    (shared,) = partitions(requests, "shared", 10)
    assert [r.block_ids for r in shared.requests] == [(1, 2), (1, 2), (1, 3)]
    (namespaced,) = partitions(requests, "namespace", 10)
    a1, b1, a2 = (r.block_ids for r in namespaced.requests)
    assert not set(a1) & set(b1)
    assert a1[0] == a2[0] and a1[1] != a2[1]
    assert [r.namespace_id for r in namespaced.requests] == ["a", "b", "a"]


def test_dedicated_partitions_get_quotas_by_demand():
    requests = [_request("a", 1, 2, 3), _request("b", 1), _request("a", 4, 5, 6)]
    parts = partitions(requests, "dedicated", 8)
    assert [(p.namespace_id, p.capacity_blocks, len(p.requests)) for p in parts] == [("a", 7, 2), ("b", 1, 1)]


def test_split_capacity_is_exact():
    assert split_capacity(10, {"a": 1, "b": 1, "c": 1}) == {"a": 4, "b": 3, "c": 3}
    assert sum(split_capacity(997, {str(i): i + 1 for i in range(13)}).values()) == 997
    assert split_capacity(5, {"a": 0}) == {"a": 0}
    with pytest.raises(ValueError, match="unknown isolation"):
        partitions([], "private", 1)


def test_sharing_more_caches_more():
    requests = generate_workload(WorkloadSpec(num_requests=1500, seed=5))

    def hit_ratio(isolation: str, policy: str) -> float:
        parts = partitions(requests, isolation, 1200)
        if policy == "belady":
            return total([replay_belady(p.requests, p.capacity_blocks) for p in parts]).prefix_hit_ratio
        counts = [
            replay(p.requests, make_policy(policy, p.capacity_blocks), p.capacity_blocks) for p in parts
        ]
        return total(counts).prefix_hit_ratio

    levels = ("shared", "namespace", "dedicated")
    shared, namespace, dedicated = (hit_ratio(level, "belady") for level in levels)
    assert shared > namespace > dedicated  # what each level can cache at best
    # An online policy can gain from the quotas' protection against other tenants' churn, so only
    # sharing is asserted to win for it.
    shared, namespace, dedicated = (hit_ratio(level, "default") for level in levels)
    assert shared > max(namespace, dedicated)
