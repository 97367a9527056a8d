"""The replay engines: exact counts on hand-built streams, leaf-first store, stranded blocks."""

from collections.abc import Callable

import pytest

from bench.replay import HitCounts, ReplayRequest, replay, total
from policies.eviction import BlockId, BlockMeta, EvictionPolicy, make_policy


class HighestIdFirst(EvictionPolicy):
    """Evicts the evictable block with the highest id: an order that ignores prefix structure."""

    name = "highest-id"

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self.blocks: set[BlockId] = set()
        self.parents: dict[BlockId, BlockId | None] = {}

    def on_insert(self, block_id: BlockId, meta: BlockMeta, now: float) -> None:
        self.blocks.add(block_id)
        self.parents[block_id] = meta.parent

    def on_hit(self, block_id: BlockId, now: float) -> None:
        pass

    def on_remove(self, block_id: BlockId) -> None:
        self.blocks.discard(block_id)

    def evict(self, can_evict: Callable[[BlockId], bool]) -> BlockId | None:
        for block_id in sorted(self.blocks, reverse=True):
            if can_evict(block_id):
                self.blocks.remove(block_id)
                return block_id
        return None

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self.blocks


def _stream(*requests: list[int]) -> list[ReplayRequest]:
    return [
        ReplayRequest(now_s=float(i), block_ids=tuple(BlockId(b) for b in r)) for i, r in enumerate(requests)
    ]


def test_flat_mode_counts_a_block_whose_parent_is_gone_as_a_flat_hit_only():
    # 10 -> 2 is a chain. Evicting the highest id drops the parent 10 and keeps its child 2.
    counts = replay(_stream([10, 2], [5], [10, 2]), HighestIdFirst(2), 2, mode="flat")
    assert counts == HitCounts(num_blocks=5, num_hits=1, num_prefix_hits=0)


def test_prefix_mode_evicts_leaves_only():
    policy = HighestIdFirst(2)
    counts = replay(_stream([10, 2], [5], [10, 2]), policy, 2, mode="prefix")
    # [5] cannot take 10 (it has a child) and evicts 2; [10, 2] reuses 10 and evicts 5 for 2.
    assert counts == HitCounts(num_blocks=5, num_hits=1, num_prefix_hits=1)
    assert policy.blocks == {10, 2}
    assert policy.parents[BlockId(2)] == 10


def test_parents_are_passed_to_the_policy_only_when_resident():
    policy = HighestIdFirst(4)
    replay(_stream([1, 2, 3]), policy, 4, mode="prefix")
    assert policy.parents == {1: None, 2: 1, 3: 2}


def test_a_request_longer_than_the_store_caches_its_head():
    policy = make_policy("lru", 2)
    counts = replay(_stream([1, 2, 3], [1, 2, 3]), policy, 2, mode="prefix")
    # the running request pins its blocks: 3 finds no room, so only [1, 2] is kept
    assert counts == HitCounts(num_blocks=6, num_hits=2, num_prefix_hits=2)
    assert len(policy) == 2


def test_lru_in_the_prefix_store():
    counts = replay(_stream([1, 2, 3], [1, 2, 4], [5, 6], [1, 2, 3]), make_policy("lru", 4), 4, mode="prefix")
    # [1,2,4]: hits 1, 2, and 4 fits. [5,6]: 5 evicts 3 (the least recent leaf); 6 passes over 1 and 2
    # (they have children) and evicts 4. [1,2,3]: hits 1, 2; 3 passes over the pinned 1, 2 and over 5
    # (parent of 6) and evicts 6.
    assert counts == HitCounts(num_blocks=11, num_hits=4, num_prefix_hits=4)


def test_counts_add_up_and_unknown_modes_fail():
    a = HitCounts(num_blocks=4, num_hits=2, num_prefix_hits=1)
    assert total([a, a]) == HitCounts(num_blocks=8, num_hits=4, num_prefix_hits=2)
    assert (a.hit_ratio, a.prefix_hit_ratio) == (0.5, 0.25)
    assert HitCounts(num_blocks=0, num_hits=0, num_prefix_hits=0).hit_ratio == 0.0
    with pytest.raises(ValueError, match="unknown replay mode"):
        replay([], make_policy("lru", 1), 1, mode="tree")
