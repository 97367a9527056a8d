"""A list's leaves in a heap, by their place in the list: what the leaf-aware eviction lists share
(``eviction_leaves``, ``eviction_shadow``, ``eviction_outside``). ``order`` maps each block of the list to
its stamp (its place: lower goes first); ``inner`` holds the blocks with children, never in the heap's
live entries. Entries go stale (touched again, left the list, gained a child) and are skipped when
popped; the heap is rebuilt from the list once stale ones outnumber the live ones."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Container, Mapping, MutableMapping

from policies.eviction_base import BlockId

Heap = list[tuple[int, BlockId]]


def push_leaf(
    heap: Heap, order: Mapping[BlockId, int], inner: Container[BlockId], stamp: int, block_id: BlockId
) -> None:
    heapq.heappush(heap, (stamp, block_id))
    if len(heap) > 2 * len(order) + 64:
        rebuild(heap, order, inner)


def rebuild(heap: Heap, order: Mapping[BlockId, int], inner: Container[BlockId]) -> None:
    """The heap again from the list's live leaves (stale entries had piled up, or it was not kept)."""
    live = [(stamp, block_id) for block_id, stamp in order.items() if block_id not in inner]
    heapq.heapify(live)
    heap[:] = live


def pop_first_leaf(
    heap: Heap,
    order: MutableMapping[BlockId, int],
    inner: Container[BlockId],
    can_evict: Callable[[BlockId], bool],
) -> BlockId | None:
    """Remove from ``order`` and return its first leaf that ``can_evict`` accepts (None: none does);
    the refused keep their places."""
    refused: Heap = []
    victim = last = None
    while heap:
        entry = heapq.heappop(heap)
        stamp, block_id = entry
        if entry == last or order.get(block_id) != stamp or block_id in inner:
            continue  # a duplicate (they pop together), stale, or an inner block
        last = entry
        if not can_evict(block_id):
            refused.append(entry)
            continue
        del order[block_id]
        victim = block_id
        break
    for entry in refused:
        heapq.heappush(heap, entry)
    return victim
