"""Prometheus exposition of the worker's counters (``GET /metrics``), read from ``Engine.stats``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

PREFIX = "prefixgate_worker_"
COUNTERS = {
    "requests_total": "Requests received",
    "requests_aborted": "Requests cancelled by their client",
    "prompt_tokens_total": "Prompt tokens received",
    "cached_tokens_total": "Prompt tokens served from a cache tier",
    "generated_tokens_total": "Tokens generated",
    "preemptions_total": "Sequences preempted and recomputed",
    "engine_errors_total": "Engine commands, steps or per-request updates that failed",
    "requests_rejected_overloaded": "Requests answered 503 because the waiting queue was full",
    "evictions_total": "Blocks evicted from the device pool",
}
GAUGES = {
    "num_blocks_total": "Blocks in the device pool",
    "num_blocks_free": "Free blocks in the device pool",
    "num_blocks_cached": "Cached (reusable) blocks in the device pool",
    "num_blocks_in_use": "Blocks referenced by running requests",
    "num_running": "Running requests",
    "num_waiting": "Waiting requests",
    "num_queued": "Requests in the bounded waiting queue (not admitted yet)",
    "num_queued_tokens": "Prompt tokens of the requests in the waiting queue",
    "prefill_tokens_per_s": "Measured prefill speed",
}

HISTOGRAMS = {
    "queue_time_seconds": "Time from arrival to first admission (blocks granted)",
    "ttft_seconds": "Time from arrival to the first generated token",
}

TIER_EVENTS = {
    "l3": (
        "blocks_written",
        "bytes_written",
        "blocks_read",
        "bytes_read",
        "blocks_refused",
        "no_room",
        "write_errors",
        "corrupt_deleted",
        "reads_evicted",
        "foreign_deleted",
        "files_evicted",
        "dir_recreated",
        "open_failed",
    ),
    "remote": ("blocks_written", "blocks_evicted", "blocks_read", "errors", "corrupt_deleted"),
}


class EngineCollector(Collector):
    def __init__(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        stats = self._stats()
        for name, doc in COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name.removesuffix("_total"), doc, value=stats.get(name, 0))
        for name, doc in GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=stats.get(name, 0))
        for name, doc in HISTOGRAMS.items():
            snap = (stats.get("histograms") or {}).get(name)
            if snap is not None:
                buckets = [(b if isinstance(b, str) else repr(b), n) for b, n in snap["buckets"]]
                yield HistogramMetricFamily(PREFIX + name, doc, buckets=buckets, sum_value=snap["sum_s"])
        tiers = stats.get("tiers") or {}
        hits = CounterMetricFamily(
            PREFIX + "tier_hit_blocks", "Cached blocks served, by tier", labels=["tier"]
        )
        for tier, value in (tiers.get("hits_blocks") or {}).items():
            hits.add_metric([tier], value)
        yield hits
        gated = CounterMetricFamily(
            PREFIX + "tier_gated_blocks", "Blocks recomputed because loading was slower", labels=["tier"]
        )
        for tier, value in (tiers.get("gated_blocks") or {}).items():
            gated.add_metric([tier], value)
        yield gated
        bandwidth = GaugeMetricFamily(
            PREFIX + "tier_bandwidth_gbps", "Measured load bandwidth", labels=["tier"]
        )
        for tier, value in (tiers.get("bandwidth_gbps") or {}).items():
            bandwidth.add_metric([tier], value)
        yield bandwidth
        events = CounterMetricFamily(
            PREFIX + "tier_events", "Tier events (writes, errors, damage)", labels=["tier", "event"]
        )
        for tier, names in TIER_EVENTS.items():
            if tier in tiers:  # every known event from 0, so rate() sees the first one
                counters = tiers[tier]
                for event in sorted(
                    set(names) | {k.removesuffix("_total") for k in counters if k.endswith("_total")}
                ):
                    events.add_metric([tier, event], counters.get(event + "_total", 0))
        yield events
        up = GaugeMetricFamily(
            PREFIX + "tier_accepting",
            "1 while a tier takes writes (disk not full, Redis reachable)",
            labels=["tier"],
        )
        for tier, key in (("l3", "accepting"), ("remote", "available")):
            if tier in tiers:
                up.add_metric([tier], tiers[tier].get(key, 0))
        yield up
        occupancy = GaugeMetricFamily(PREFIX + "tier_blocks", "Blocks held by a lower tier", labels=["tier"])
        capacity = GaugeMetricFamily(
            PREFIX + "tier_bytes", "Bytes held by a lower tier and its budget", labels=["tier", "kind"]
        )
        if "l2" in tiers:
            occupancy.add_metric(["l2"], tiers["l2"].get("blocks", 0))
        if "l3" in tiers:
            occupancy.add_metric(["l3"], tiers["l3"].get("blocks", 0))
            capacity.add_metric(["l3", "used"], tiers["l3"].get("bytes", 0))
            capacity.add_metric(["l3", "budget"], tiers["l3"].get("budget_bytes", 0))
        yield occupancy
        yield capacity
        dropped = CounterMetricFamily(
            PREFIX + "demotions_dropped", "Blocks not demoted because the writer queue was full"
        )
        dropped.add_metric([], tiers.get("demotions_dropped_total", 0))
        yield dropped


def render(stats: Callable[[], Mapping[str, Any]]) -> bytes:
    """The exposition text for one scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(stats))
    return generate_latest(registry)
