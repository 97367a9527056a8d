"""Prometheus metrics on a per-app registry (no global registry state).

Per-tenant series are labelled with the tenant id, or with an opaque keyed hash of it
(``tenant_labels="hash"``: the tenant's namespace id, which only admins can map back). The endpoint
itself needs a bearer token (``gateway.app``): the counters are live per-tenant prompt lengths.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
OVERHEAD_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)


TENANT_LABEL_MODES = ("id", "hash")


class GatewayMetrics:
    def __init__(self, *, tenant_label: Callable[[str], str] | None = None) -> None:
        self.tenant_label: Callable[[str], str] = tenant_label or (lambda tenant_id: tenant_id)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._per_tenant: list[tuple[Counter, tuple[str, ...]]] = []  # metric, its label names
        self.requests = self.tenant_counter(
            "prefixgate_requests", "Tenant API requests", ("tenant", "endpoint", "status")
        )
        self.prompt_tokens = self.tenant_counter("prefixgate_prompt_tokens", "Prompt tokens")
        self.cached_tokens = self.tenant_counter(
            "prefixgate_cached_tokens", "Prompt tokens served from cache", ("tenant", "tier")
        )
        self.completion_tokens = self.tenant_counter("prefixgate_completion_tokens", "Completion tokens")
        self.saved_prefill_seconds = self.tenant_counter(
            "prefixgate_saved_prefill_seconds", "Estimated prefill time saved by cache hits"
        )
        self.latency = Histogram(
            "prefixgate_request_duration_seconds",
            "Request latency (to the last byte)",
            ["endpoint"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.prepare_latency = Histogram(
            "prefixgate_prepare_duration_seconds",
            "Gateway work before the worker call (render, tokenize, hash, route)",
            ["endpoint"],
            buckets=OVERHEAD_BUCKETS_S,
            registry=r,
        )
        self.queue_time = Histogram(
            "prefixgate_queue_seconds",
            "From arrival to the worker call (admission, CPU pool wait, render, tokenize, route)",
            ["endpoint"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.ttft = Histogram(
            "prefixgate_time_to_first_token_seconds",
            "From arrival to the first streamed event from the worker",
            ["endpoint"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.in_flight = Gauge("prefixgate_requests_in_flight", "Tenant requests in flight", registry=r)
        self.auth_failures = Counter("prefixgate_auth_failures", "Rejected tenant API keys", registry=r)
        self.spool_depth = Gauge(
            "prefixgate_usage_spool_depth", "Usage records waiting in the spool", registry=r
        )
        self.usage_pending = Gauge(
            "prefixgate_usage_pending", "Usage records waiting for the next batch write", registry=r
        )
        self.usage_rejected = Gauge(
            "prefixgate_usage_rejected",
            "Usage records the database refused, kept aside and retried (GET /admin/v1/usage/rejected)",
            registry=r,
        )
        self.usage_write_failures = Gauge(
            "prefixgate_usage_write_failures",
            "Failed usage writes since start, by target (database: spooled; spool: kept in memory)",
            ["target"],
            registry=r,
        )
        self.workers_healthy = Gauge("prefixgate_workers_healthy", "Healthy workers", registry=r)
        self.canonicalization_fragments = self.tenant_counter(
            "prefixgate_canonicalization_fragments",
            "Dynamic fragments moved out of the cacheable prefix (mode on) or found (mode report)",
            ("tenant", "action"),
        )
        self.promotions = Counter(
            "prefixgate_hot_prefix_promotions", "Hot prefixes promoted by this replica", registry=r
        )
        self.promotion_errors = Counter(
            "prefixgate_promotion_counter_errors",
            "Hot-prefix counter failures (promotion pauses, requests are served as usual)",
            registry=r,
        )
        self.hot_prefixes = Gauge("prefixgate_hot_prefixes", "Promoted hot prefixes in force", registry=r)
        self.promoted_prefix_tokens = self.tenant_counter(
            "prefixgate_promoted_prefix_tokens",
            "Cached prompt tokens that came from a promoted (global) hot prefix",
        )
        self.purges = Counter("prefixgate_purges", "Tenant purges", ["outcome"], registry=r)
        self.purged_blocks = Counter(
            "prefixgate_purged_blocks", "KV blocks erased by tenant purges", ["tier"], registry=r
        )
        self.near_miss_routes = Counter(
            "prefixgate_near_miss_routes",
            "Near-miss consultations: moved to a similar prompt's worker, or kept the exact route",
            ["outcome"],
            registry=r,
        )
        self.near_miss_tokens = self.tenant_counter(
            "prefixgate_near_miss_tokens",
            "Cached prompt tokens beyond the exact index's prediction on near-miss routes",
        )
        self.near_miss_embed_seconds = Histogram(
            "prefixgate_near_miss_embed_seconds",
            "Prompt-head embedding time of a near-miss consultation (its own thread)",
            buckets=(*OVERHEAD_BUCKETS_S, 0.25, 0.5, 1.0),
            registry=r,
        )
        self.kv_event_batches_refused = Counter(
            "prefixgate_kv_event_batches_refused",
            "Worker KV-event answers refused (malformed, or over kv_events_max_bytes): the worker was "
            "dropped from the routing index and is read again from its first event",
            ["reason"],
            registry=r,
        )
        self.policy_age = Gauge(
            "prefixgate_policy_snapshot_age_seconds",
            "Seconds since the policy cache was last checked",
            registry=r,
        )

    def tenant_counter(self, name: str, documentation: str, labels: tuple[str, ...] = ("tenant",)) -> Counter:
        """A counter with a ``tenant`` label (``tenant_label(tenant_id)``) on this registry: its series of
        a deleted tenant are dropped by ``forget_tenants``."""
        if "tenant" not in labels:
            raise ValueError(f"{name}: a per-tenant counter needs a 'tenant' label")
        counter = Counter(name, documentation, labels, registry=self.registry)
        self._per_tenant.append((counter, labels))
        return counter

    def forget_tenants(self, tenant_ids: Iterable[str]) -> int:
        """Drop every per-tenant series of a tenant not in ``tenant_ids`` (the tenants of the policy
        snapshot just loaded: every replica drops a deleted tenant's series at its next reload, else
        /metrics would grow with every tenant ever created). Returns the number of series dropped."""
        live = {self.tenant_label(tenant_id) for tenant_id in tenant_ids}
        num_dropped = 0
        for counter, labels in self._per_tenant:
            gone = {
                tuple(sample.labels[name] for name in labels)
                for family in counter.collect()
                for sample in family.samples
                if sample.labels.get("tenant") not in live
            }
            for label_values in gone:
                counter.remove(*label_values)
            num_dropped += len(gone)
        return num_dropped

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
