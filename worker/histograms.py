"""Latency histograms (queue time, time to first token) for the worker's Prometheus metrics."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(slots=True)
class LatencyHistogram:
    """Observed by the engine thread, read by scrapes (a torn read is off by one sample at most)."""

    buckets_s: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))  # last: +Inf
    sum_s: float = 0.0

    def observe(self, value_s: float) -> None:
        self.counts[bisect.bisect_left(self.buckets_s, value_s)] += 1
        self.sum_s += value_s

    def snapshot(self) -> dict[str, object]:
        """Cumulative counts per upper bound (Prometheus style: the last bound is "+Inf"), sum and count.

        Strict JSON: the unbounded bucket's bound is the string "+Inf", never a float infinity.
        """
        cumulative: list[tuple[float | str, int]] = []
        total = 0
        for bound, count in zip((*self.buckets_s, "+Inf"), list(self.counts), strict=True):
            total += count
            cumulative.append((bound, total))
        return {"buckets": cumulative, "sum_s": self.sum_s, "count": total}
