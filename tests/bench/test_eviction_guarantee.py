"""The default eviction policy never loses to the textbook policies, on every trace of the evaluation set.

For each trace of ``bench.evalset`` (compact prefixes of them, so that CI runs it in well under a
minute) and each capacity of 1 / 5 / 10 / 20 % of the unique blocks, the default's prefix-usable hit
ratio in the worker's prefix store is at least ``max(LRU, ARC) - 0.005``; and on the whole Mooncake
synthetic trace at 5 % it is at least 1.10 × LRU's. Held-out traces are in the set like the others.
"""

import pytest

from bench.evalset import evaluation_set
from bench.hitrate import simulate_one
from bench.trace import num_unique_blocks
from policies.eviction import DEFAULT_POLICY

FRACTIONS = (0.01, 0.05, 0.1, 0.2)
NOISE = 0.005


@pytest.mark.parametrize("trace", evaluation_set(), ids=lambda t: t.name)
def test_default_is_at_least_the_best_textbook_policy(trace):
    requests = trace.load(compact=True)
    num_unique = num_unique_blocks(requests)
    shortfalls = []
    for fraction in FRACTIONS:
        capacity = max(1, int(fraction * num_unique))
        ours = simulate_one(requests, "default", capacity).prefix_hit_ratio
        best = max(simulate_one(requests, name, capacity).prefix_hit_ratio for name in ("lru", "arc"))
        if ours < best - NOISE:
            shortfalls.append(f"{fraction:.0%}: {DEFAULT_POLICY} {ours:.4f} < best {best:.4f} - {NOISE}")
    assert not shortfalls, f"{trace.name}: " + "; ".join(shortfalls)


def test_default_beats_lru_by_ten_percent_on_the_synthetic_trace():
    (mooncake,) = (t for t in evaluation_set() if t.family == "mooncake")
    requests = mooncake.load()
    capacity = int(0.05 * num_unique_blocks(requests))
    ours = simulate_one(requests, "default", capacity).prefix_hit_ratio
    lru = simulate_one(requests, "lru", capacity).prefix_hit_ratio
    assert ours >= 1.10 * lru, f"{ours:.4f} < 1.10 × {lru:.4f}"
