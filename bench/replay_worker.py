"""Replay a request stream through the worker's own ``BlockManager`` (``bench.hitrate --mode worker``).

``bench.replay``'s ``prefix`` mode is a model of the worker's store. This mode runs the real one, driven
the way the scheduler drives it, one request at a time: ``match_prefix``, ``acquire`` (which reports the
hits to the policy in prompt order), ``allocate_many`` (every eviction before any insert), ``cache``
of each new block in prompt order, ``release``. The worker never calls ``on_miss``. A request whose new
blocks do not all fit gets as many as are free or evictable, as the model stops admitting.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from bench.replay import HitCounts, ReplayRequest
from policies.eviction import EvictionPolicy
from worker.block_manager import BlockManager


def replay_worker(
    requests: Iterable[ReplayRequest],
    policy: EvictionPolicy,
    capacity_blocks: int,
    on_request: Callable[[], None] | None = None,
) -> HitCounts:
    """Hit counts of ``requests`` in a ``BlockManager`` of ``capacity_blocks`` one-token blocks."""
    now = [0.0]
    manager = BlockManager(capacity_blocks, 1, eviction_policy="lru", clock=lambda: now[0])
    manager.policy = policy  # the caller's object, as the other modes drive it (nothing inserted yet)
    policy.declare_leaf_only()  # as the manager does for the policy it makes
    num_blocks = num_hits = num_prefix_hits = 0
    for request in requests:
        now[0] = request.now_s
        # A block's hash is its id (policies see the low 64 bits, the id itself); its one token too.
        hashes = [block_id.to_bytes(16, "little") for block_id in request.block_ids]
        tokens = [(block_id,) for block_id in request.block_ids]
        num_blocks += len(hashes)
        num_hits += sum(h in manager.hash_to_block_id for h in hashes)
        matched = manager.match_prefix(hashes, tokens)
        num_prefix_hits += len(matched)
        manager.acquire(matched)
        num_available = manager.num_available_blocks(request.namespace_id, ignore_reservations=True)
        new = manager.allocate_many(
            min(len(hashes) - len(matched), num_available), request.namespace_id, ignore_reservations=True
        )
        for k, block in enumerate(new, start=len(matched)):
            manager.cache(
                block,
                hashes[k],
                tokens[k],
                hashes[k - 1] if k else None,
                namespace_id=request.namespace_id,
                position=k,
                request_blocks=len(hashes),
            )
        manager.release(matched + new)
        if on_request is not None:
            on_request()
    return HitCounts(num_blocks=num_blocks, num_hits=num_hits, num_prefix_hits=num_prefix_hits)
