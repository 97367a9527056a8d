"""LRU: exact eviction order, hits, pins and removals."""

from policies.eviction import BlockId, BlockMeta, LRUPolicy


def _meta() -> BlockMeta:
    return BlockMeta(position=0, parent=None)


def _always(block_id: BlockId) -> bool:
    return True


def test_evicts_least_recently_used_first():
    lru = LRUPolicy(4)
    for block_id in (1, 2, 3):
        lru.on_insert(BlockId(block_id), _meta(), 0.0)
    lru.on_hit(BlockId(1), 1.0)
    assert [lru.evict(_always) for _ in range(4)] == [2, 3, 1, None]


def test_pinned_blocks_keep_their_place():
    lru = LRUPolicy(4)
    for block_id in (1, 2, 3):
        lru.on_insert(BlockId(block_id), _meta(), 0.0)
    assert lru.evict(lambda b: b != 1) == 2
    assert lru.evict(_always) == 1
    assert lru.evict(lambda b: False) is None
    assert len(lru) == 1


def test_removed_blocks_are_forgotten():
    lru = LRUPolicy(4)
    for block_id in (1, 2):
        lru.on_insert(BlockId(block_id), _meta(), 0.0)
    lru.on_remove(BlockId(1))
    lru.on_remove(BlockId(9))  # unknown ids are ignored
    assert 1 not in lru
    assert lru.evict(_always) == 2
