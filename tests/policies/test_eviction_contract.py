"""Every registered policy keeps the protocol's contract under the pool's usage pattern.

A small prefix store drives the policy with random requests over a few shared chains: it pins the
running request's blocks, lets only leaves go (leaf-first), purges subtrees now and then, and checks
that the policy only names evictable tracked blocks and names one whenever one exists.
"""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.eviction import POLICIES, BlockId, BlockMeta, make_policy


class _Store:
    """The owner: resident blocks with their parents, pins of the running request."""

    def __init__(self, policy_name: str, capacity: int) -> None:
        self.policy = make_policy(policy_name, capacity)
        self.capacity = capacity
        self.parent_of: dict[BlockId, BlockId | None] = {}
        self.pinned: set[BlockId] = set()

    def children(self, block_id: BlockId) -> list[BlockId]:
        return [b for b, p in self.parent_of.items() if p == block_id]

    def can_evict(self, block_id: BlockId) -> bool:
        return block_id not in self.pinned and not self.children(block_id)

    def evict_one(self) -> bool:
        evictable = [b for b in self.parent_of if self.can_evict(b)]
        victim = self.policy.evict(self.can_evict)
        if victim is None:
            assert not evictable, "policy found no victim although one was evictable"
            return False
        assert victim in self.parent_of and self.can_evict(victim)
        assert victim not in self.policy
        del self.parent_of[victim]
        return True

    def request(self, chain: list[BlockId]) -> None:
        self.pinned.clear()
        parent = None
        for position, block_id in enumerate(chain):
            if block_id in self.parent_of:
                self.policy.on_hit(block_id, 0.0)
            else:
                self.policy.on_miss(block_id, 0.0)
                if len(self.parent_of) >= self.capacity and not self.evict_one():
                    return
                self.parent_of[block_id] = parent
                self.policy.on_insert(block_id, BlockMeta(position=position, parent=parent), 0.0)
            self.pinned.add(block_id)
            parent = block_id

    def purge(self, block_id: BlockId) -> None:
        for child in self.children(block_id):
            self.purge(child)
        del self.parent_of[block_id]
        self.policy.on_remove(block_id)

    def check(self) -> None:
        assert len(self.policy) == len(self.parent_of)
        for block_id in self.parent_of:
            assert block_id in self.policy


def _chains(rng: random.Random) -> list[list[BlockId]]:
    """A few chains sharing prefixes: ids follow the prefix tree, so equal ids mean equal prefixes."""
    node_ids: dict[tuple[int, int], BlockId] = {}
    chains = []
    for _ in range(12):
        parent, chain = -1, []
        for position in range(rng.randint(1, 8)):
            branch = rng.randint(0, 2) if position else rng.randint(0, 1)
            parent = node_ids.setdefault((parent, branch), BlockId(len(node_ids)))
            chain.append(parent)
        chains.append(chain)
    return chains


@pytest.mark.parametrize("policy_name", sorted(POLICIES))
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), capacity=st.integers(1, 16))
def test_contract_under_a_prefix_store(policy_name, seed, capacity):
    rng = random.Random(seed)
    chains = _chains(rng)
    store = _Store(policy_name, capacity)
    for _ in range(60):
        if store.parent_of and rng.random() < 0.05:
            store.pinned.clear()
            store.purge(rng.choice(sorted(store.parent_of)))
        else:
            store.request(rng.choice(chains))
        store.check()
    store.pinned.clear()
    while store.parent_of:
        assert store.evict_one()
        store.check()
    assert store.policy.evict(store.can_evict) is None
