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

Every replay is independent and deterministic, so the module hands every replay to a pool of worker
processes (one per available core, at most ``MAX_WORKERS``) and each test waits for its own: the same
real policies on the same traces, spread over the cores a serial test run leaves idle (on one core it
costs what the serial replays cost, plus each worker's import and trace loading). The workers come
from a fork server, not a fork of the test process: by this point that process holds other tests'
threads (torch's, the gateway's pools), and a fork copies any lock one of them holds.
"""

import functools
import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor

import pytest

from bench.evalset import EvalTrace, evaluation_set
from bench.hitrate import simulate_one
from bench.trace import TraceRequest, num_unique_blocks

FRACTIONS = (0.01, 0.05, 0.1, 0.2)
NOISE = 0.005
FULL = os.environ.get("PREFIXGATE_EVALSET_FULL") == "1"
MAX_WORKERS = 4
COMPACT_SHORTFALLS = {  # (trace, fraction): compact-prefix cells below max(LRU, ARC) - 0.005
    ("mooncake-synthetic", 0.2),
    ("mixed-default", 0.1),
    ("chat-long", 0.05),
    ("agent-tools", 0.2),
    ("agent-long", 0.2),
    ("mixed-skewed", 0.2),
    # evict9's whole-trace guard (it starts after 16 capacities, inside the 40 k-access prefix): chat-busy
    # 5 % 0.2593 and agent-long 10 % 0.2853 against 0.2675 and 0.2945; at full size both hold (-0.0008,
    # -0.0003). It took chat-wide 10 %, agent-bursty 5 % and agent-bursty 20 % (held out) off this list.
    ("chat-busy", 0.05),
    ("agent-long", 0.1),
}
SYNTHETIC = "mooncake-synthetic"


@functools.cache
def _requests(trace_name: str, compact: bool) -> list[TraceRequest]:
    (trace,) = (t for t in evaluation_set() if t.name == trace_name)
    return trace.load(compact=compact)


def _prefix_hit_ratio(trace_name: str, compact: bool, fraction: float, policy: str) -> float:
    """One replay (run in a worker process): the policy's prefix-usable hit ratio on one cell."""
    requests = _requests(trace_name, compact)
    capacity = max(1, int(fraction * num_unique_blocks(requests)))
    return simulate_one(requests, policy, capacity).prefix_hit_ratio


@pytest.fixture(scope="module")
def replays(request):
    """(trace, compact, fraction, policy) -> the future of its hit ratio, for the selected tests' cells.

    Every replay is submitted at once, the longest (the full synthetic trace) first.
    """
    workers = max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))
    cells = []
    for item in request.session.items:
        if item.module is not request.module:
            continue
        if item.originalname == test_default_beats_lru_by_ten_percent_on_the_synthetic_trace.__name__:
            cells[:0] = [(SYNTHETIC, False, 0.05, policy) for policy in ("default", "lru")]
        else:
            trace, fraction = item.callspec.params["trace"], item.callspec.params["fraction"]
            cells += [(trace.name, not FULL, fraction, policy) for policy in ("default", "lru", "arc")]
    context = multiprocessing.get_context("forkserver")  # each worker loads the traces it needs, once
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures: dict[tuple, Future[float]] = {cell: pool.submit(_prefix_hit_ratio, *cell) for cell in cells}
        yield futures
        for future in futures.values():
            future.cancel()


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
def test_default_is_at_least_the_best_textbook_policy(trace: EvalTrace, fraction: float, replays):
    ours, lru, arc = (replays[trace.name, not FULL, fraction, p].result() for p in ("default", "lru", "arc"))
    best = max(lru, arc)
    assert ours >= best - NOISE, f"default {ours:.4f} < max(LRU, ARC) {best:.4f} - {NOISE}"


def test_default_beats_lru_by_ten_percent_on_the_synthetic_trace(replays):
    ours, lru = (replays[SYNTHETIC, False, 0.05, p].result() for p in ("default", "lru"))
    assert ours >= 1.10 * lru, f"{ours:.4f} < 1.10 × {lru:.4f}"
