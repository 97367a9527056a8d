"""LRU and ARC behind an owner that evicts leaves only: the list walk's victims, only leaves asked."""

from __future__ import annotations

import random

import pytest

from policies.eviction import AdaptivePolicy, ARCPolicy, BlockId, BlockMeta, LRUPolicy
from policies.eviction_leaves import LeafARCPolicy, LeafLRUPolicy
from tests.policies.test_eviction_adaptive_equivalence import CASES, _digest, _Recorded


class _PrefixStore:
    """A leaf-only owner: chains of blocks, a pinned prompt, some leaves refused (reserved), purges."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.parent_of: dict[BlockId, BlockId | None] = {}
        self.num_children: dict[BlockId, int] = {}
        self.pinned: set[BlockId] = set()
        self.reserved: set[BlockId] = set()
        self.asked_inner: list[BlockId] = []  # blocks with resident children that a policy asked about

    def can_evict(self, block_id: BlockId) -> bool:
        if block_id in self.num_children:
            self.asked_inner.append(block_id)
            return False
        return block_id not in self.pinned and block_id not in self.reserved

    def add(self, block_id: BlockId, parent: BlockId | None) -> None:
        self.parent_of[block_id] = parent
        if parent is not None:
            self.num_children[parent] = self.num_children.get(parent, 0) + 1

    def remove(self, block_id: BlockId) -> None:
        parent = self.parent_of.pop(block_id)
        if parent is not None and parent in self.parent_of:
            left = self.num_children.pop(parent) - 1
            if left:
                self.num_children[parent] = left
        self.num_children.pop(block_id, None)


def _drive(reference, leafy, *, capacity: int, seed: int, follower: bool) -> int:
    """Drive both policies with the same calls; assert the same victims; return how many evictions."""
    store = _PrefixStore(seed)
    rng = store.rng
    leafy.declare_leaf_only()
    evictions = 0
    for step in range(1500):
        store.pinned.clear()
        store.reserved = {b for b in store.parent_of if rng.random() < 0.05}
        if store.parent_of and rng.random() < 0.02:  # purge a root's subtree, parents before children
            root = rng.choice([b for b, p in store.parent_of.items() if p is None])
            doomed = {root}
            for block_id in list(store.parent_of):
                chain, node = [], block_id
                while node is not None and node not in doomed:
                    chain.append(node)
                    node = store.parent_of.get(node)
                if node is not None:
                    doomed.update(chain)
            for block_id in sorted(doomed, key=lambda b: rng.random()):
                reference.on_remove(block_id)
                leafy.on_remove(block_id)
                store.remove(block_id)
        doc = rng.randrange(12)
        length = rng.randrange(1, 9)
        parent: BlockId | None = None
        for position in range(length):
            block_id = BlockId(doc * 100 + position + (step % 3 == 0) * 50 * (position > 3))
            if block_id in store.parent_of:
                hits = [block_id, BlockId(99_999)] if step % 5 == 0 else [block_id]  # untracked: ignored
                reference.on_hits(hits, float(step))
                leafy.on_hits(hits, float(step))
                store.pinned.add(block_id)
                parent = block_id
                continue
            reference.on_miss(block_id, float(step))
            leafy.on_miss(block_id, float(step))
            if len(store.parent_of) >= capacity:
                if follower and rng.random() < 0.3:  # another policy chose: a random evictable leaf
                    choices = sorted(b for b in store.parent_of if store.can_evict(b))
                    victim = rng.choice(choices) if choices else None
                    if victim is not None:
                        reference.on_evicted(victim)
                        leafy.on_evicted(victim)
                else:
                    victim = reference.evict(store.can_evict)
                    asked = len(store.asked_inner)
                    assert leafy.evict(store.can_evict) == victim, step
                    assert len(store.asked_inner) == asked, "the leaf-only policy asked about an inner block"
                if victim is None:
                    break
                evictions += 1
                store.remove(victim)
            if parent is not None and parent not in store.parent_of:
                parent = None
            meta = BlockMeta(position=position, parent=parent)
            reference.on_insert(block_id, meta, float(step))
            leafy.on_insert(block_id, meta, float(step))
            store.add(block_id, parent)
            store.pinned.add(block_id)
            parent = block_id
        assert len(reference) == len(leafy) == len(store.parent_of)
    return evictions


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("follower", [False, True])
def test_leaf_lru_evicts_what_lru_evicts(seed, follower):
    assert _drive(LRUPolicy(40), LeafLRUPolicy(40), capacity=40, seed=seed, follower=follower) > 500


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("follower", [False, True])
def test_leaf_arc_evicts_what_arc_evicts(seed, follower):
    reference, leafy = ARCPolicy(40), LeafARCPolicy(40)
    assert _drive(reference, leafy, capacity=40, seed=seed, follower=follower) > 500
    assert leafy.target_t1_blocks == reference.target_t1_blocks
    assert list(leafy._b1) == list(reference._b1) and list(leafy._b2) == list(reference._b2)


def _chain(policy, first: int, length: int) -> None:
    for position in range(length):
        parent = None if position == 0 else BlockId(first + position - 1)
        policy.on_miss(BlockId(first + position), 0.0)
        policy.on_insert(BlockId(first + position), BlockMeta(position=position, parent=parent), 0.0)


def test_the_default_asks_a_leaf_only_owner_about_leaves_only():
    # Behind the worker's BlockManager the leader used to walk past every inner block of the oldest
    # chains, asking can_evict about each, for every victim (quadratic in the prompt's length).
    policy = AdaptivePolicy(64)
    policy.declare_leaf_only()
    for doc in range(8):
        _chain(policy, 1000 * doc, 8)
    resident = {BlockId(1000 * doc + k): k < 7 for doc in range(8) for k in range(8)}  # -> has a child
    asked: list[BlockId] = []

    def can_evict(block_id: BlockId) -> bool:
        asked.append(block_id)
        return not resident[block_id]

    victims = []
    for _ in range(16):
        victim = policy.evict(can_evict)
        victims.append(victim)
        del resident[victim]
        parent = BlockId(victim - 1) if victim % 1000 else None
        if parent is not None:
            resident[parent] = False
    assert victims == [BlockId(7 - k) for k in range(8)] + [BlockId(1007 - k) for k in range(8)]
    assert asked == victims


def test_a_flat_owner_still_gets_the_oldest_block():
    # Without the promise (the flat replay: any block may go) the leader's list walk is kept, so ARC
    # evicts the first block inserted, a chain's root.
    policy = AdaptivePolicy(64)
    _chain(policy, 0, 8)
    assert policy.evict(lambda block_id: True) == BlockId(0)


def test_the_promise_comes_before_the_first_insert():
    policy = AdaptivePolicy(8)
    _chain(policy, 0, 2)
    with pytest.raises(RuntimeError):
        policy.declare_leaf_only()


class _ListWalk(_Recorded):
    """The default as a flat owner drives it: the promise ignored, the followers walk their lists."""

    def declare_leaf_only(self) -> None:
        pass


@pytest.mark.parametrize(
    "case", [CASES[0], CASES[3], CASES[4]], ids=lambda case: "-".join(map(str, case[:3]))
)
def test_both_follower_kinds_make_the_recorded_decisions(case):
    # The equivalence digests (recorded before any of this) run the leaf followers behind the prefix and
    # worker replays; the list walk must still make the same decisions, switches included.
    name, fraction, mode, _, digest, num_leaders = case
    assert _digest(name, fraction, mode, _ListWalk) == (digest, num_leaders)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("follower", [False, True])
def test_the_default_evicts_what_its_list_walk_evicts(seed, follower):
    # The leader's shadow-first lists too: behind a leaf-only owner the default asks about leaves only
    # (it used to ask about every block its leader's shadow had dropped, in use or inner, per victim).
    leafy = AdaptivePolicy(40)
    assert _drive(_ListWalk(40), leafy, capacity=40, seed=seed, follower=follower) > 500
