"""S3-FIFO: small/main/ghost queues, exact eviction order (libCacheSim's S3FIFO.c semantics)."""

from policies.eviction import BlockId, BlockMeta, S3FIFOPolicy


def _meta() -> BlockMeta:
    return BlockMeta(position=0, parent=None)


def _always(block_id: BlockId) -> bool:
    return True


def _filled(capacity: int) -> S3FIFOPolicy:
    policy = S3FIFOPolicy(capacity)
    for block_id in range(1, capacity + 1):
        policy.on_miss(BlockId(block_id), 0.0)
        policy.on_insert(BlockId(block_id), _meta(), 0.0)
    return policy


def test_queue_sizes_follow_libcachesim():
    policy = S3FIFOPolicy(20)
    assert (policy.small_capacity, policy.main_capacity, policy.ghost_capacity) == (2, 18, 18)


def test_before_the_first_eviction_a_full_small_queue_sends_blocks_to_main():
    policy = _filled(20)
    assert list(policy._small) == [1, 2]
    assert list(policy._main) == list(range(3, 21))


def test_small_evicts_once_seen_blocks_to_ghost_and_promotes_twice_hit_ones():
    policy = _filled(20)
    policy.on_hit(BlockId(2), 1.0)
    policy.on_hit(BlockId(2), 1.0)
    assert policy.evict(_always) == 1  # small head, never hit: to ghost
    policy.on_miss(BlockId(21), 2.0)
    policy.on_insert(BlockId(21), _meta(), 2.0)  # after an eviction new blocks enter small
    assert list(policy._small) == [2, 21]
    assert policy.evict(_always) == 21  # 2 (hit twice) moved to main on the way
    assert list(policy._main)[-1] == 2 and list(policy._ghost) == [1, 21]
    assert policy.evict(_always) == 3  # main is over its share now: its head goes


def test_a_ghost_hit_enters_main_directly():
    policy = _filled(20)
    assert policy.evict(_always) == 1
    policy.on_miss(BlockId(1), 1.0)
    assert 1 not in policy._ghost
    assert policy.evict(_always) == 2  # small still holds 2: it is evicted first
    policy.on_insert(BlockId(1), _meta(), 1.0)
    assert list(policy._main)[-1] == 1 and 1 not in policy._small


def test_main_is_a_clock_with_a_two_bit_counter():
    policy = S3FIFOPolicy(20)
    for block_id in range(1, 21):
        policy.on_insert(BlockId(block_id), _meta(), 0.0)
    for _ in range(5):
        policy.on_hit(BlockId(3), 1.0)  # saturates at 3
    for block_id in (1, 2):
        policy.on_remove(BlockId(block_id))  # empty small: evictions come from main
    victims = [policy.evict(_always) for _ in range(18)]
    assert victims == [*range(4, 21), 3]  # 3 survives three laps, then goes last


def test_pinned_blocks_are_passed_over_like_a_clock_hand():
    policy = _filled(20)
    assert policy.evict(lambda b: b != 1) == 2
    assert list(policy._small) == [1]
    assert policy.evict(lambda b: False) is None
    assert len(policy) == 19


def test_on_insert_without_on_miss_still_sees_the_ghost():
    policy = _filled(20)
    assert policy.evict(_always) == 1
    policy.on_insert(BlockId(1), _meta(), 1.0)
    assert 1 in policy._main and 1 not in policy._ghost
