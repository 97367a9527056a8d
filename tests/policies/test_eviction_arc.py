"""ARC: T1/T2 lists, ghost lists B1/B2 and the adaptive target p, in exact order."""

from policies.eviction import ARCPolicy, BlockId, BlockMeta


def _miss(policy: ARCPolicy, block_id: int, *, room: bool) -> BlockId | None:
    """What an owner does on a miss: tell the policy, make room if the cache is full, insert."""
    policy.on_miss(BlockId(block_id), 0.0)
    victim = None if room else policy.evict(lambda b: True)
    policy.on_insert(BlockId(block_id), BlockMeta(position=0, parent=None), 0.0)
    return victim


def test_ghost_hits_move_the_target_and_promote():
    arc = ARCPolicy(2)
    _miss(arc, 1, room=True)
    _miss(arc, 2, room=True)
    arc.on_hit(BlockId(1), 0.0)  # T1=[2], T2=[1]
    assert _miss(arc, 3, room=False) == 2  # T1 over p=0: its LRU goes to B1
    assert (list(arc._t1), list(arc._t2), list(arc._b1)) == ([3], [1], [2])
    assert _miss(arc, 2, room=False) == 1  # B1 hit: p=1, T1 at p, so T2's LRU goes to B2
    assert arc.target_t1_blocks == 1
    assert (list(arc._t1), list(arc._t2), list(arc._b2)) == ([3], [2], [1])
    assert _miss(arc, 1, room=False) == 3  # B2 hit: p=0, T1's LRU goes to B1
    assert arc.target_t1_blocks == 0
    assert (list(arc._t1), list(arc._t2), list(arc._b1)) == ([], [2, 1], [3])


def test_pinned_blocks_are_skipped_and_the_other_list_serves():
    arc = ARCPolicy(3)
    for block_id in (1, 2, 3):
        _miss(arc, block_id, room=True)
    arc.on_hit(BlockId(3), 0.0)  # T1=[1, 2], T2=[3]
    assert arc.evict(lambda b: b != 1) == 2
    assert arc.evict(lambda b: b == 3) == 3
    assert arc.evict(lambda b: False) is None
    assert list(arc._t1) == [1]


def test_removed_blocks_leave_no_ghost():
    arc = ARCPolicy(2)
    _miss(arc, 1, room=True)
    arc.on_remove(BlockId(1))
    assert len(arc) == 0 and not arc._b1
