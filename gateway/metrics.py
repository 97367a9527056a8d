"""Prometheus metrics on a per-app registry (no global registry state).

Per-tenant series are labelled with the tenant id, or with an opaque keyed hash of it
(``tenant_labels="hash"``: the tenant's namespace id, which only admins can map back). The endpoint
itself needs a bearer token (``gateway.app``): the counters are live per-tenant prompt lengths.

Per-tenant counters (``TenantCounter``) are written by tenant id and remember which series each tenant
has, so a policy reload drops a deleted tenant's series by visiting only the tenants that left (walking
every counter's samples held the event loop ~1 s per reload at 10,000 tenants), and a tenant that left
writes nothing more: its request still in flight at the delete cannot bring its series back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
OVERHEAD_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)


TENANT_LABEL_MODES = ("id", "hash")


class _Discarded:
    """A write to a tenant that has left the policy snapshot: it goes nowhere."""

    __slots__ = ()

    def inc(self, amount: float = 1) -> None:
        pass


_DISCARDED = _Discarded()


class TenantCounter:
    """A Prometheus counter whose first label is the tenant, written by tenant id (``of``), that knows
    each tenant's series (``forget`` drops them without walking the others')."""

    __slots__ = ("_metrics", "_tenant_to_series", "counter")

    def __init__(self, counter: Counter, metrics: GatewayMetrics) -> None:
        self.counter = counter
        self._metrics = metrics
        self._tenant_to_series: dict[str, set[tuple[str, ...]]] = {}  # tenant id -> its label values

    def of(self, tenant_id: str, *labels: str) -> Counter | _Discarded:
        """The series of ``tenant_id`` (labelled ``tenant_label(tenant_id)``) and the other ``labels``;
        a write that goes nowhere once the tenant has left the policy snapshot."""
        metrics = self._metrics
        if not metrics.is_live(tenant_id):
            return _DISCARDED
        label_values = (metrics.label_of(tenant_id), *labels)
        series = self._tenant_to_series.get(tenant_id)
        if series is None:
            series = self._tenant_to_series[tenant_id] = set()
            metrics.tenant_ids_with_series.add(tenant_id)
        series.add(label_values)
        return self.counter.labels(*label_values)

    def forget(self, tenant_id: str) -> int:
        """Drop every series of ``tenant_id``; returns how many there were."""
        series = self._tenant_to_series.pop(tenant_id, ())
        for label_values in series:
            self.counter.remove(*label_values)
        return len(series)


class GatewayMetrics:
    def __init__(self, *, tenant_label: Callable[[str], str] | None = None) -> None:
        self.tenant_label: Callable[[str], str] = tenant_label or (lambda tenant_id: tenant_id)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._per_tenant: list[TenantCounter] = []
        self.tenant_ids_with_series: set[str] = set()  # in any TenantCounter (filled by ``of``)
        self._tenant_to_label: dict[str, str] = {}  # tenant_label's answers, for tenants with series
        self._live_tenant_ids: frozenset[str] | None = None  # the policy snapshot's; None: none yet
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
        self.near_miss_embed_waits = Counter(
            "prefixgate_near_miss_embed_waits",
            "Near-miss FAISS searches by how the head's embedding came: at_hand (cached by text or word "
            "pieces, no wait), in_time, late (not ready by the request's arrival + near_miss_max_wait_ms: "
            "routed without it), expired (that deadline had passed before the wait began: no wait), "
            "indexed (not searched: the KV-event index sees whatever FAISS could find)",
            ["outcome"],
            registry=r,
        )
        self.near_miss_wait_overrun_seconds = Histogram(
            "prefixgate_near_miss_wait_overrun_seconds",
            "How far past its deadline a late near-miss embedding wait ended (the bound's timer fires "
            "when the event loop gets a CPU)",
            buckets=OVERHEAD_BUCKETS_S,
            registry=r,
        )
        self.policy_age = Gauge(
            "prefixgate_policy_snapshot_age_seconds",
            "Seconds since the policy cache was last checked",
            registry=r,
        )

    def tenant_counter(
        self, name: str, documentation: str, labels: tuple[str, ...] = ("tenant",)
    ) -> TenantCounter:
        """A counter labelled ``tenant`` first (``tenant_label(tenant_id)``), then ``labels[1:]``, on this
        registry: its series of a deleted tenant are dropped by ``forget_tenants``."""
        if labels[:1] != ("tenant",):
            raise ValueError(f"{name}: a per-tenant counter needs 'tenant' as its first label")
        counter = TenantCounter(Counter(name, documentation, labels, registry=self.registry), self)
        self._per_tenant.append(counter)
        return counter

    def is_live(self, tenant_id: str) -> bool:
        """False once the policy snapshot no longer shows ``tenant_id`` (its series are gone)."""
        live = self._live_tenant_ids
        return live is None or tenant_id in live

    def label_of(self, tenant_id: str) -> str:
        """``tenant_label(tenant_id)``, computed once per tenant (a keyed hash in ``hash`` mode)."""
        label = self._tenant_to_label.get(tenant_id)
        if label is None:
            label = self._tenant_to_label[tenant_id] = self.tenant_label(tenant_id)
        return label

    def forget_tenants(self, tenant_ids: Iterable[str]) -> int:
        """Drop every per-tenant series of a tenant not in ``tenant_ids`` (the tenants of the policy
        snapshot just loaded: every replica drops a deleted tenant's series at its next reload, else
        /metrics would grow with every tenant ever created), and write none for such a tenant from now
        on. Visits only the tenants that have series and left. Returns the number of series dropped."""
        live = frozenset(tenant_ids)
        self._live_tenant_ids = live
        departed = self.tenant_ids_with_series - live
        num_dropped = 0
        for tenant_id in departed:
            for counter in self._per_tenant:
                num_dropped += counter.forget(tenant_id)
            self._tenant_to_label.pop(tenant_id, None)
        self.tenant_ids_with_series -= departed
        return num_dropped

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
