"""S3-FIFO in a prefix store: a head that still has resident children gives way to its descendants."""

from policies.eviction import BlockId, BlockMeta, S3FIFOPolicy


def _insert(policy: S3FIFOPolicy, block_id: int, parent: int | None, position: int) -> None:
    meta = BlockMeta(position=position, parent=None if parent is None else BlockId(parent))
    policy.on_miss(BlockId(block_id), 0.0)
    policy.on_insert(BlockId(block_id), meta, 0.0)


def test_a_head_with_children_sends_its_evictable_descendants_first():
    policy = S3FIFOPolicy(10)  # too small for a small queue: every block enters main, in FIFO order
    for block_id, parent, position in ((1, None, 0), (10, None, 0), (2, 1, 1), (3, 2, 2)):
        _insert(policy, block_id, parent, position)
    parent_of = {2: 1, 3: 2}
    resident = {1, 2, 3, 10}

    def leaf_only(block_id: BlockId) -> bool:  # the store's rule: blocks with resident children stay
        return not any(parent == block_id and child in resident for child, parent in parent_of.items())

    order = []
    for _ in range(4):
        victim = policy.evict(leaf_only)
        order.append(victim)
        resident.discard(victim)
    # Head 1 is not rotated behind 10: its chain goes tail first, then 1 itself, then 10.
    assert order == [3, 2, 1, 10]


def test_a_pinned_head_without_evictable_descendants_is_passed_over():
    policy = S3FIFOPolicy(20)
    for block_id, parent, position in ((1, None, 0), (2, 1, 1), (10, None, 0)):
        _insert(policy, block_id, parent, position)
    pinned = {1, 2}
    assert policy.evict(lambda b: b not in pinned) == 10
