"""The prefix-aware policy: leaf-first order, probation, reuse memory, rate ranking, pins, learning."""

import time

from policies.eviction import BlockId, BlockMeta, PrefixAwarePolicy
from policies.eviction_prefix import PROTECTED


def _insert(policy: PrefixAwarePolicy, block_id: int, parent: int | None = None, position: int = 0) -> None:
    meta = BlockMeta(position=position, parent=None if parent is None else BlockId(parent))
    policy.on_miss(BlockId(block_id), 0.0)
    policy.on_insert(BlockId(block_id), meta, 0.0)


def _always(block_id: BlockId) -> bool:
    return True


def _drain(policy: PrefixAwarePolicy) -> list[BlockId | None]:
    return [policy.evict(_always) for _ in range(len(policy) + 1)]


def test_sizes_scale_with_capacity():
    policy = PrefixAwarePolicy(400)
    assert policy.ghost_capacity == 6400
    assert policy.probe_window == 100
    assert policy.rate_prior == 100 and policy.recency_scale == 400


def test_chains_are_evicted_leaf_first():
    policy = PrefixAwarePolicy(8)
    for block_id, parent in ((1, None), (2, 1), (3, 2), (4, 1)):
        _insert(policy, block_id, parent)
    # 1 is the oldest block, but it is the parent of everything: its children go first, newest last
    # only among leaves (2 becomes a leaf once 3 is gone).
    assert _drain(policy) == [3, 2, 4, 1, None]


def test_blocks_seen_once_go_before_reused_blocks():
    policy = PrefixAwarePolicy(8)
    _insert(policy, 1)
    policy.on_hit(BlockId(1), 1.0)  # reused: protected
    _insert(policy, 2)
    _insert(policy, 3)
    assert _drain(policy) == [2, 3, 1, None]


def test_reuse_memory_outlives_eviction():
    policy = PrefixAwarePolicy(8)
    _insert(policy, 1)
    assert policy.evict(_always) == 1
    _insert(policy, 1)  # recomputed after eviction: its second access, so protected
    block = policy._blocks[BlockId(1)]
    assert (block.segment, block.num_accesses, block.first_clock) == (PROTECTED, 2, 1)


def test_protected_blocks_rank_by_reuse_rate_and_recency():
    policy = PrefixAwarePolicy(4)  # rate prior 1 access, recency scale 4 accesses
    _insert(policy, 10)  # clock 1
    _insert(policy, 91)  # clock 2
    _insert(policy, 92)  # clock 3
    _insert(policy, 20)  # clock 4
    policy.on_hit(BlockId(20), 0.0)  # clock 5: 20 reused after 1 tick: rate 2/(1+1), key 5 + 4 ln 1 = 5
    _insert(policy, 93)  # clock 6
    _insert(policy, 94)  # clock 7
    policy.on_hit(BlockId(10), 0.0)  # clock 8: 10 reused after 7 ticks: rate 2/(7+1), key 8 + 4 ln 0.25 ≈ 2.5
    # LRU would evict 20 before 10; the slower-reused 10 goes first here.
    assert _drain(policy) == [91, 92, 93, 94, 10, 20, None]


def test_pinned_leaves_are_set_aside_and_keep_their_rank():
    policy = PrefixAwarePolicy(8)
    for block_id in (1, 2, 3):
        _insert(policy, block_id)
    assert policy.evict(lambda b: b != 1) == 2
    assert policy.evict(lambda b: False) is None
    assert _drain(policy) == [1, 3, None]


def test_a_pinned_leaf_does_not_expose_its_parent():
    policy = PrefixAwarePolicy(8)
    _insert(policy, 1)
    _insert(policy, 2, parent=1)
    assert policy.evict(lambda b: b != 2) is None  # 1 still has a child, 2 is pinned


def test_removing_a_child_makes_the_parent_a_leaf():
    policy = PrefixAwarePolicy(8)
    _insert(policy, 1)
    _insert(policy, 2, parent=1)
    _insert(policy, 3)
    policy.on_remove(BlockId(2))
    policy.on_remove(BlockId(7))  # unknown ids are ignored
    assert _drain(policy) == [1, 3, None]


def test_misses_on_recent_victims_move_the_probation_target():
    policy = PrefixAwarePolicy(8)
    _insert(policy, 1)
    _insert(policy, 2)
    policy.on_hit(BlockId(2), 0.0)
    assert policy.evict(_always) == 1  # probation victim
    _insert(policy, 1)  # missed right after: probation was too small
    assert policy.target_probation_blocks == 1
    policy.on_remove(BlockId(1))
    assert policy.evict(_always) == 2  # protected victim
    policy.on_miss(BlockId(2), 0.0)  # missed right after: protected was too small
    assert policy.target_probation_blocks == 0


def test_probation_under_its_target_is_spared():
    policy = PrefixAwarePolicy(8)
    policy.target_probation_blocks = 2
    _insert(policy, 1)
    policy.on_hit(BlockId(1), 0.0)
    _insert(policy, 2)
    assert policy.evict(_always) == 1  # probation holds 1 block, under its target of 2
    assert policy.evict(_always) == 2


def test_ghost_memory_is_bounded():
    policy = PrefixAwarePolicy(2)
    for block_id in range(100):
        _insert(policy, block_id)
        policy.evict(_always)
    assert len(policy._history) == policy.ghost_capacity == 32


def test_stale_heap_entries_are_compacted():
    policy = PrefixAwarePolicy(4)
    for block_id in (1, 2):
        _insert(policy, block_id)
    for _ in range(1000):
        policy.on_hit(BlockId(1), 0.0)
    assert len(policy._leaves[1]) <= 2 * len(policy) + 64 + 1
    assert _drain(policy) == [2, 1, None]


def test_large_pool_operations_stay_cheap():
    """The worker's pool: ~100k blocks in chains, steady eviction, a few pinned blocks."""
    capacity = 100_000
    policy = PrefixAwarePolicy(capacity)
    pinned = {BlockId(0)}
    started = time.perf_counter()
    next_id = 0
    for chain in range(6000):
        parent = None
        for position in range(32):
            block_id = BlockId(next_id)
            next_id += 1
            if len(policy) >= capacity:
                assert policy.evict(lambda b: b not in pinned) is not None
            policy.on_insert(block_id, BlockMeta(position=position, parent=parent), float(chain))
            parent = block_id
        if chain % 3 == 0:
            policy.on_hit(BlockId(next_id - 32), float(chain))
    assert len(policy) == capacity
    assert time.perf_counter() - started < 10.0  # ~192k inserts, ~92k evictions
