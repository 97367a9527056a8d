"""Near-miss routing: when the exact KV index finds little, route to a worker holding a similar prompt.

For tenants that enable it (``near_miss_routing``), every routed prompt is remembered per namespace
key: its tokens and the worker it went to, among the namespace's ``recent_per_namespace`` latest. When
the exact index finds fewer than ``min_blocks`` cached blocks on every worker, the latest prompts of the
request's own namespace keys (its tenant key, plus the global key when its prefix is promoted) are
nominated. Each nominee is verified on tokens (``policies.near_miss``): only the blocks the two prompts
share exactly, under the same keys, count; the request goes to the nominee's worker if that beats the
exact route. An index is keyed by namespace *key*, so no search ever sees another tenant's prompts (nor
this tenant's prompts of an earlier epoch) - except the `shared` tenants', who share the global key and
its cache by choice: their prompts nominate each other's routes, but each is remembered with its tenant,
only the tenant's own make its findings, and a deleted tenant's are dropped from the global key.

FAISS is on only with a wait bound (``max_wait_s`` > 0; default 0): then cold prompts are also embedded
in the background (``gateway.embedding``, its own thread) into a FAISS inner-product index per key, and
a request whose latest prompts share too little, in a namespace with vectors to search, waits at most
``max_wait_s`` for its head's embedding (ahead of queued background ones) and nominates its nearest
too. The bound is a deadline from the request's arrival, checked when the wait ends; a head the tenant
already embedded (text or word pieces) is at hand without a wait; and with the KV-aware router over the
KV-event index, which sees every stored block a nominee could lend, a request searches only while the
latest prompts may not reach back to every prompt still in flight. Embeddings never decide reuse.
Without a bound nothing is embedded and no request waits: measured on ``bench.routing``, with the
KV-event index on, FAISS found nothing the latest prompts had not, and its embeddings took CPU from the
workers (docs/routing.md).

The diverging span of a near miss (where the two prompts part) is kept per tenant as a candidate
canonicalization rule (``/v1/prompt-lint``, the admin API), shared by replicas through Redis when
they have one (``gateway.near_miss_findings``). Invalidate, purge and delete forget a tenant here and
in Redis (``forget_tenant``); other replicas forget it when their policies show its new epoch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from gateway.embedding import EMBEDDING_DIM, PromptEmbedder
from gateway.metrics import GatewayMetrics
from gateway.model import ModelRuntime
from gateway.near_miss_findings import DivergingSpan, LocalFindings, RedisFindings
from gateway.near_miss_forget import PolicySource, TenantForgetting
from gateway.near_miss_memory import NamespaceVectors, Remembered, best_nominee, diverging_span
from gateway.routing import KVAwareRouter, RouteRequest, WorkerLoad
from policies.hashing import NamespaceSegment
from policies.near_miss import layout_of
from tenancy.policy import TenantPolicy


@dataclass(frozen=True, kw_only=True, slots=True)
class NearMissRoute:
    worker_url: str
    exact_tokens: int | None  # None: the exact route stood; else the exact index's cached tokens there


class NearMissRouting(TenantForgetting):
    def __init__(
        self,
        *,
        embedder: PromptEmbedder,
        metrics: GatewayMetrics | None = None,
        min_blocks: int = 4,
        head_tokens: int = 128,
        top_k: int = 4,
        max_prompt_tokens: int = 8192,
        capacity_per_namespace: int = 1024,
        max_wait_s: float = 0.0,
        recent_per_namespace: int = 16,
        findings: LocalFindings | RedisFindings | None = None,
        policies: PolicySource | None = None,
        sweep_s: float = 1.0,
        exact_index_live: bool = False,
        in_flight_s: float = 2.0,
    ) -> None:
        """``findings``: a ``LocalFindings`` or ``RedisFindings`` store (default: this replica's own).
        ``policies``: the tenant policies in force (``tenancy.cache.PolicyCache``); every ``sweep_s``
        the tenants whose epoch moved or who were deleted, through any replica, are forgotten here.
        ``exact_index_live``: the exact route is the KV-aware router's over the KV-event index, which
        sees every stored block a FAISS nominee could lend; FAISS can then add only a prompt still being
        prefilled (not stored yet) that is no longer among the latest, so it is searched only when the
        latest prompts were all routed within ``in_flight_s`` (the router's own bound on a prefill,
        ``leader_hold_s``): a burst larger than the latest prompts hold."""
        self.embedder = embedder
        self._metrics = metrics
        self.min_blocks = min_blocks
        self.head_tokens = head_tokens
        self.top_k = top_k
        self.max_prompt_tokens = max_prompt_tokens
        self._capacity = capacity_per_namespace
        self.max_wait_s = max_wait_s
        self.recent_per_namespace = recent_per_namespace
        self._cost = KVAwareRouter().cost_tokens
        self._recent: dict[tuple[str, bytes], deque[Remembered]] = {}
        self._findings = findings if findings is not None else LocalFindings()
        self._vectors: dict[tuple[str, bytes], NamespaceVectors] = {}
        # Which (model, key) pairs each tenant's prompts are remembered under, and the newest tenant
        # epoch seen: a purge or invalidation (an epoch bump) drops them all (under the global key,
        # which every `shared` tenant uses, only the tenant's own prompts). A request or background add
        # prepared at an older epoch (before the purge) is refused by that number alone (``_stale``):
        # one per tenant, where a set of every purged key grew with each purge for ever.
        self._keys_of: dict[str, set[tuple[str, bytes]]] = {}
        self._epoch_of: dict[str, int] = {}
        self._background: set[asyncio.Task] = set()
        self._policies = policies
        self._sweep_s = sweep_s
        self._sweeper: asyncio.Task | None = None
        self.exact_index_live = exact_index_live
        self.in_flight_s = in_flight_s

    # ---- the routing decision ------------------------------------------------------------------
    async def route(
        self,
        tenant: TenantPolicy,
        model: ModelRuntime,
        token_ids: Sequence[int],
        segments: Sequence[NamespaceSegment],
        request: RouteRequest,
        exact_url: str,
        *,
        arrived_s: float | None = None,
    ) -> NearMissRoute:
        """The worker for this request: ``exact_url`` unless a verified near miss beats it.

        ``arrived_s`` (``time.perf_counter()``, default now): when the request reached the gateway; an
        embedding is waited for until ``arrived_s`` + ``max_wait_s`` at most, and one that comes later
        is not used for this request."""
        deadline_s = (time.perf_counter() if arrived_s is None else arrived_s) + self.max_wait_s
        self._observe_epoch(tenant)
        if self._stale(tenant.tenant_id, tenant.epoch):  # prepared before its tenant was purged: keep out
            return NearMissRoute(worker_url=exact_url, exact_tokens=None)
        by_url = {worker.url: worker for worker in request.candidates}
        tokens = np.asarray(token_ids[: self.max_prompt_tokens], dtype=np.int32)
        # The decoded head is for the embedder only: without a wait bound nothing is embedded.
        head = model.decode(token_ids[: self.head_tokens]) if self.max_wait_s > 0 else ""
        if max(worker.cached_blocks for worker in request.candidates) >= self.min_blocks:
            # The exact index covers this prefix, and so every later prompt that shares it: remembered
            # by tokens among the latest (findings), never embedded (no CPU taken from the workers).
            self._remember(tenant, model, tokens, segments, exact_url, head, embed=False)
            return NearMissRoute(worker_url=exact_url, exact_tokens=None)
        # The namespace's latest prompts first, by tokens alone: a burst of similar prompts finds its
        # first one at once, before that one's blocks (or its embedding) exist.
        nominees = self._recent_of(model.model_id, segments)
        best = best_nominee(tokens, segments, nominees, by_url, request.block_size)
        vector, late = None, False
        if (
            (best is None or best[0] < self.min_blocks)
            and self._searchable(model.model_id, segments)
            and self._beyond_the_index(model.model_id, segments)
        ):
            vector = await self._embed_within_bound(head, tenant.tenant_id, deadline_s)
            if self._stale(tenant.tenant_id, tenant.epoch):  # purged while it waited: remember nothing
                return NearMissRoute(worker_url=exact_url, exact_tokens=None)
            late = vector is None and self.max_wait_s > 0
            if vector is not None:
                found = [entry for _, entry in self._search(model.model_id, segments, vector)]
                nominees += found
                better = best_nominee(tokens, segments, found, by_url, request.block_size)
                if better is not None and (best is None or better[0] > best[0]):
                    best = better
        self._record_finding(tenant, model, tokens, segments, nominees, request.block_size)
        chosen = exact_url
        exact_tokens: int | None = None
        if (
            best is not None
            and best[1].worker_url != exact_url  # the exact route goes there anyway: nothing to credit
            and self._worth_moving(request, by_url[exact_url], by_url[best[1].worker_url], best[0])
        ):
            chosen = best[1].worker_url
            exact_tokens = by_url[chosen].cached_blocks * request.block_size
        self._count("moved" if exact_tokens is not None else "late" if late else "kept")
        self._remember(tenant, model, tokens, segments, chosen, head, vector)
        return NearMissRoute(worker_url=chosen, exact_tokens=exact_tokens)

    def _worth_moving(
        self, request: RouteRequest, exact: WorkerLoad, other: WorkerLoad, reusable_blocks: int
    ) -> bool:
        """Whether the request should leave its exact route for ``other``, where it would reuse
        ``reusable_blocks``: more reuse than the exact route has, a lower cost by the KV-aware router's
        measure, and no more requests in flight there (a few reused blocks do not pay for waiting
        behind whole prefills: moving every near duplicate of a burst onto one worker doubled TTFT)."""
        if reusable_blocks <= exact.cached_blocks or other.in_flight > exact.in_flight:
            return False
        with_reuse = replace(
            other, cached_weighted_blocks=max(other.cached_weighted_blocks, float(reusable_blocks))
        )
        return self._cost(request, with_reuse) < self._cost(request, exact)

    async def _embed_within_bound(self, head: str, tenant_id: str, deadline_s: float) -> np.ndarray | None:
        """The head's embedding if it is at hand (no wait), or computed ahead of queued background ones
        by ``deadline_s`` (``perf_counter``: the request's arrival + the bound); else None.

        The deadline is checked when the wait ends, not left to the loop's timer alone: on a saturated
        machine the timer fires when the loop gets a CPU, and a vector may come in after the deadline.
        Such a vector is not used (the request goes as it would have gone at its deadline); each outcome
        is counted (``prefixgate_near_miss_embed_waits_total``) and the overrun observed."""
        vector = self.embedder.at_hand(head, tenant=tenant_id)
        if vector is not None or self.max_wait_s <= 0:
            self._count_wait("at_hand" if vector is not None else "")
            return vector
        started = time.perf_counter()
        if started >= deadline_s:  # its budget went before routing (a loaded loop, a follower's hold)
            self._count_wait("expired")
            return None
        job = asyncio.ensure_future(self.embedder.embed(head, urgent=True, tenant=tenant_id))
        try:
            vector = await asyncio.wait_for(asyncio.shield(job), deadline_s - started)
        except TimeoutError:  # the job goes on: its vector lands in the LRU for _remember
            vector = None
        ended = time.perf_counter()
        if self._metrics is not None:
            self._metrics.near_miss_embed_seconds.observe(ended - started)
            if ended > deadline_s:
                self._metrics.near_miss_wait_overrun_seconds.observe(ended - deadline_s)
        if vector is None or ended > deadline_s:
            self._count_wait("late")
            return None
        self._count_wait("in_time")
        return vector

    def _count_wait(self, outcome: str) -> None:
        if self._metrics is not None and outcome:
            self._metrics.near_miss_embed_waits.labels(outcome).inc()

    def _count(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.near_miss_routes.labels(outcome).inc()

    def _recent_of(self, model_id: str, segments: Sequence[NamespaceSegment]) -> list[Remembered]:
        """The latest prompts remembered under the request's own keys, newest first."""
        keys = {bytes(seg.key) for seg in segments}
        return [entry for key in keys for entry in reversed(self._recent.get((model_id, key), ()))]

    def _searchable(self, model_id: str, segments: Sequence[NamespaceSegment]) -> bool:
        """Whether any of the request's namespace keys has remembered prompts (else nothing to find)."""
        return any(self._vectors.get((model_id, bytes(seg.key))) for seg in segments)

    def _beyond_the_index(self, model_id: str, segments: Sequence[NamespaceSegment]) -> bool:
        """Whether FAISS may find what neither the exact index nor the latest prompts show (see
        ``exact_index_live``): always without a live index; with one, only while some key's latest
        prompts are full and were all routed within ``in_flight_s`` (an older one may still be in flight)."""
        if not self.exact_index_live:
            return True
        now = time.monotonic()
        for key in {bytes(seg.key) for seg in segments}:
            recent = self._recent.get((model_id, key))
            if recent and len(recent) == recent.maxlen and now - recent[0].routed_s < self.in_flight_s:
                return True
        self._count_wait("indexed")
        return False

    def _search(
        self, model_id: str, segments: Sequence[NamespaceSegment], vector: np.ndarray
    ) -> list[tuple[float, Remembered]]:
        hits: list[tuple[float, Remembered]] = []
        for key in {bytes(seg.key) for seg in segments}:  # the request's own keys only
            vectors = self._vectors.get((model_id, key))
            if vectors is not None:
                hits += vectors.search(vector, self.top_k)
        return sorted(hits, key=lambda hit: -hit[0])[: self.top_k]

    # ---- remembering prompts -------------------------------------------------------------------
    def _remember(
        self,
        tenant: TenantPolicy,
        model: ModelRuntime,
        tokens: np.ndarray,
        segments: Sequence[NamespaceSegment],
        url: str,
        head: str,
        vector: np.ndarray | None = None,
        *,
        embed: bool = True,
    ) -> None:
        """Remember a routed prompt: among the namespace's latest at once, in FAISS once embedded (in the
        background, off the request's path; shed when embeddings queue up; not at all without ``embed``)."""
        own_key = bytes(segments[-1].key)
        if self._stale(tenant.tenant_id, tenant.epoch):  # its tenant was purged after it was prepared
            return
        self._keys_of.setdefault(tenant.tenant_id, set()).add((model.model_id, own_key))
        if self._sweeper is None and self._policies is not None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())
        entry = Remembered(
            token_ids=tokens,
            layout=layout_of(segments),
            worker_url=url,
            own_key=own_key,
            tenant_id=tenant.tenant_id,
            epoch=tenant.epoch,
            routed_s=time.monotonic(),
        )
        recent = self._recent.get((model.model_id, own_key))
        if recent is None:
            recent = self._recent[(model.model_id, own_key)] = deque(maxlen=self.recent_per_namespace)
        recent.append(entry)
        if vector is None and head:
            vector = self.embedder.at_hand(head, tenant=tenant.tenant_id)
        if vector is not None:
            self._add(model.model_id, entry, vector)
            return
        if not embed or self.max_wait_s <= 0:
            return  # without a wait bound no request ever searches FAISS: an embedding would be wasted

        async def remember() -> None:
            try:
                embedded = await self.embedder.embed(head, urgent=False, tenant=tenant.tenant_id)
            except (asyncio.CancelledError, RuntimeError):  # the embedder closed, or shed (EmbeddingShed):
                # each tenant has its own bounded background queue, so one tenant's flood sheds only its own
                return
            self._add(model.model_id, entry, embedded)

        self._spawn(remember())

    def _add(self, model_id: str, entry: Remembered, vector: np.ndarray) -> None:
        if self._stale(entry.tenant_id, entry.epoch):  # embedded after its tenant was purged
            return
        if (model_id, entry.own_key) not in self._keys_of.get(entry.tenant_id, ()):  # tenant forgotten since
            return
        vectors = self._vectors.get((model_id, entry.own_key))
        if vectors is None:
            vectors = NamespaceVectors(EMBEDDING_DIM, self._capacity)
            self._vectors[(model_id, entry.own_key)] = vectors
        vectors.add(vector, entry)

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def num_remembered(self, tenant_id: str | None = None) -> int:
        """Prompts remembered (embedded) over every namespace, or one tenant's (tests, benchmarks)."""
        if tenant_id is None:
            return sum(len(vectors) for vectors in self._vectors.values())
        pairs = self._keys_of.get(tenant_id, ())
        return sum(vectors.num_of(tenant_id) for pair in pairs if (vectors := self._vectors.get(pair)))

    # ---- findings ------------------------------------------------------------------------------
    def _record_finding(
        self,
        tenant: TenantPolicy,
        model: ModelRuntime,
        tokens: np.ndarray,
        segments: Sequence[NamespaceSegment],
        nominees: Sequence[Remembered],
        block_size: int,
    ) -> None:
        """Keep where the request parted from its closest prompt of its own tenant (``diverging_span``)."""
        if self._stale(tenant.tenant_id, tenant.epoch):  # its tenant was purged after it was prepared
            return
        span = diverging_span(tenant.tenant_id, model, tokens, segments, nominees, block_size)
        if span is not None:
            self._spawn(self._keep_finding(tenant, span))  # Redis, if any, stays off the path

    async def _keep_finding(self, tenant: TenantPolicy, span: DivergingSpan) -> None:
        """Record a finding in the background, unless its tenant was forgotten since it was found (a
        forget may run before this task does); Redis refuses it if a forget there is newer."""
        if not self._stale(tenant.tenant_id, tenant.epoch):
            await self._findings.record(tenant.tenant_id, span, epoch=tenant.epoch)

    async def findings(self, tenant_id: str) -> list[dict[str, Any]]:
        """The tenant's recent diverging spans (every replica's, with Redis), newest first."""
        return await self._findings.recent(tenant_id)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._background:
            await asyncio.wait(self._background, timeout=2)
        self.embedder.close()
        await self._findings.close()
