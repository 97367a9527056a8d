"""Belady's MIN: the offline upper bound on any policy's hit ratio for a given capacity.

Each block's next use is the next request that holds it, ordered within a request by position. On a
miss with a full cache, MIN compares the missing block's next use with the furthest next use among the
resident blocks and keeps the nearer one: it evicts the furthest, or does not admit the missing block
(bypass). For unit-size blocks this is optimal (Belady 1966; Mattson et al. 1970).

It is also a fair bound for the prefix store. Every request holding a block also holds its parent, at
an earlier position, so a parent's next use is always before its children's: MIN never evicts a block
while keeping a child, its cache is always parent-closed (the store's leaf-first invariant), and all its
hits are prefix-usable. No online policy, in either replay mode, can get more flat or prefix hits.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from bench.replay import HitCounts, ReplayRequest


def next_use_keys(requests: Sequence[ReplayRequest]) -> list[list[int]]:
    """For every block of every request, the key of the block's next use (larger: later).

    The key of request ``i``, position ``j`` is ``i * stride + j``; a block never used again gets a key
    past every real one, still ordered by position so that parents go before their children.
    """
    stride = max((len(r.block_ids) for r in requests), default=0) + 1
    never = (len(requests) + 1) * stride
    next_key: dict[int, int] = {}
    keys: list[list[int]] = [[] for _ in requests]
    for index in range(len(requests) - 1, -1, -1):
        block_ids = requests[index].block_ids
        row = [0] * len(block_ids)
        for position in range(len(block_ids) - 1, -1, -1):
            block_id = block_ids[position]
            row[position] = next_key.get(block_id, never + position)
            next_key[block_id] = index * stride + position
        keys[index] = row
    return keys


def replay_belady(
    requests: Sequence[ReplayRequest],
    capacity_blocks: int,
    *,
    on_request: Callable[[], None] | None = None,
) -> HitCounts:
    """Hit counts of MIN with bypass over ``requests`` in a cache of ``capacity_blocks`` blocks."""
    keys = next_use_keys(requests)
    resident: dict[int, int] = {}  # block -> key of its next use
    furthest: list[tuple[int, int]] = []  # max-heap of (-next use, block); stale entries skipped
    num_blocks = num_hits = num_prefix_hits = 0
    for request, row in zip(requests, keys, strict=True):
        num_blocks += len(row)
        in_prefix = True
        for block_id, next_key in zip(request.block_ids, row, strict=True):
            if block_id in resident:
                num_hits += 1
                num_prefix_hits += in_prefix
            else:
                in_prefix = False
                if len(resident) >= capacity_blocks:
                    while furthest and resident.get(furthest[0][1]) != -furthest[0][0]:
                        heapq.heappop(furthest)
                    if not furthest or -furthest[0][0] < next_key:
                        continue  # bypass: every resident block is needed sooner
                    del resident[heapq.heappop(furthest)[1]]
            resident[block_id] = next_key
            heapq.heappush(furthest, (-next_key, block_id))
        if on_request is not None:
            on_request()
    return HitCounts(num_blocks=num_blocks, num_hits=num_hits, num_prefix_hits=num_prefix_hits)
