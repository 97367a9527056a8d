"""LRU: least recently used first; pinned blocks are skipped in place."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from policies.eviction_base import BlockId, BlockMeta, EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self._order: OrderedDict[BlockId, None] = OrderedDict()

    def on_insert(self, block_id: BlockId, meta: BlockMeta, now: float) -> None:
        self._order[block_id] = None
        self._order.move_to_end(block_id)

    def on_hit(self, block_id: BlockId, now: float) -> None:
        if block_id in self._order:
            self._order.move_to_end(block_id)

    def on_hits(self, block_ids: Sequence[BlockId], now: float) -> None:
        order = self._order
        for block_id in block_ids:
            if block_id in order:
                order.move_to_end(block_id)

    def on_remove(self, block_id: BlockId) -> None:
        self._order.pop(block_id, None)

    def evict(self, can_evict: Callable[[BlockId], bool]) -> BlockId | None:
        for block_id in self._order:
            if can_evict(block_id):
                del self._order[block_id]
                return block_id
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._order
