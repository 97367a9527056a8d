"""The registry: names, the default, and the public names of policies.eviction."""

import pytest

from policies.eviction import (
    DEFAULT_POLICY,
    POLICIES,
    AdaptivePolicy,
    ARCPolicy,
    BlockId,
    BlockMeta,
    EvictionPolicy,
    LRUPolicy,
    PrefixAwarePolicy,
    S3FIFOPolicy,
    make_policy,
)


def test_registry_holds_every_policy_by_its_name():
    assert dict(POLICIES) == {
        "lru": LRUPolicy,
        "s3fifo": S3FIFOPolicy,
        "arc": ARCPolicy,
        "prefix": PrefixAwarePolicy,
        "adaptive": AdaptivePolicy,
    }


def test_default_is_the_adaptive_policy():
    assert DEFAULT_POLICY == "adaptive"
    policy = make_policy("default", 100)
    assert isinstance(policy, AdaptivePolicy)
    assert policy.capacity_blocks == 100
    assert policy.leader_name == "arc"  # until its shadows show another expert doing better


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_make_policy_builds_a_fresh_empty_policy(name):
    policy = make_policy(name, 64)
    assert isinstance(policy, EvictionPolicy)
    assert len(policy) == 0
    assert BlockId(1) not in policy
    assert policy.evict(lambda block_id: True) is None
    policy.on_insert(BlockId(1), BlockMeta(position=0, parent=None), 0.0)
    assert BlockId(1) in policy and len(policy) == 1


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match="adaptive, arc, lru, prefix, s3fifo"):
        make_policy("mru", 10)
