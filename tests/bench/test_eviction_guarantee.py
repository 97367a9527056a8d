"""The default eviction policy against the textbook policies, on every trace of the evaluation set.

The issue's guarantee: in the worker's prefix store, at 1 / 5 / 10 / 20 % of the unique blocks, the
default's prefix-usable hit ratio is at least ``max(LRU, ARC) - 0.005`` on every trace of
``bench.evalset``, and at least 1.10 × LRU's at 5 % on the Mooncake synthetic trace.

The guarantee is about the workloads, i.e. the full-size traces: ``PREFIXGATE_EVALSET_FULL=1`` replays
every cell at full size, with no exception (about ten minutes on one core; ``python -m bench.evalset``
prints the same cells with the other policies). A plain run replays compact prefixes of the traces
(``COMPACT_BLOCKS`` block accesses each) so that the suite stays fast. A 40 k-access prefix is the
start of a trace: the caches have just filled, ARC's and the prefix policy's learned sizes are still
moving, and a switch between experts costs a fraction of a capacity that a short trace cannot earn
back. The cells where the compact prefix falls short are listed in ``COMPACT_SHORTFALLS`` and run as
strict xfails: measured on every run, and the day one holds, the test fails until it is taken off the
list. ``docs/eviction.md`` shows that 80 k-access prefixes still miss 5 cells that pass at full size.
"""

import os

import pytest

from bench.evalset import EvalTrace, evaluation_set
from bench.hitrate import simulate_one
from bench.trace import TraceRequest, num_unique_blocks

FRACTIONS = (0.01, 0.05, 0.1, 0.2)
NOISE = 0.005
FULL = os.environ.get("PREFIXGATE_EVALSET_FULL") == "1"
COMPACT_SHORTFALLS = {  # (trace, fraction): compact-prefix cells below max(LRU, ARC) - 0.005
    ("mooncake-synthetic", 0.2),
    ("mixed-default", 0.1),
    ("rag-docs", 0.1),
    ("chat-long", 0.05),
    ("agent-tools", 0.2),
    ("chat-slow", 0.2),
    ("chat-busy", 0.1),
    ("agent-long", 0.2),
    ("mixed-skewed", 0.2),
    # Held out (fresh): found by the one run after the default was fixed, not used to tune it.
    ("chat-wide", 0.1),
    ("agent-bursty", 0.2),
}


@pytest.fixture(scope="module")
def traces() -> dict[str, list[TraceRequest]]:
    return {}


def _cases() -> list:
    cases = []
    for trace in evaluation_set():
        for fraction in FRACTIONS:
            marks = [pytest.mark.slow] if FULL else []
            if not FULL and (trace.name, fraction) in COMPACT_SHORTFALLS:
                marks.append(pytest.mark.xfail(strict=True, reason="compact prefix: learner warm-up"))
            cases.append(pytest.param(trace, fraction, marks=marks, id=f"{trace.name}-{fraction:.0%}"))
    return cases


@pytest.mark.parametrize(("trace", "fraction"), _cases())
def test_default_is_at_least_the_best_textbook_policy(trace: EvalTrace, fraction: float, traces):
    if trace.name not in traces:
        traces[trace.name] = trace.load(compact=not FULL)
    requests = traces[trace.name]
    capacity = max(1, int(fraction * num_unique_blocks(requests)))
    ours = simulate_one(requests, "default", capacity).prefix_hit_ratio
    best = max(simulate_one(requests, name, capacity).prefix_hit_ratio for name in ("lru", "arc"))
    assert ours >= best - NOISE, f"default {ours:.4f} < max(LRU, ARC) {best:.4f} - {NOISE}"


def test_default_beats_lru_by_ten_percent_on_the_synthetic_trace():
    (mooncake,) = (t for t in evaluation_set() if t.name == "mooncake-synthetic")
    requests = mooncake.load()
    capacity = int(0.05 * num_unique_blocks(requests))
    ours = simulate_one(requests, "default", capacity).prefix_hit_ratio
    lru = simulate_one(requests, "lru", capacity).prefix_hit_ratio
    assert ours >= 1.10 * lru, f"{ours:.4f} < 1.10 × {lru:.4f}"
