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
too. Embeddings never decide reuse. Without a bound nothing is embedded and no request waits: measured
on ``bench.routing``, with the KV-event index on, FAISS found nothing the latest prompts had not, and its
embeddings took CPU from the workers (docs/routing.md).

The diverging span of a near miss (where the two prompts part) is kept per tenant as a candidate
canonicalization rule (``/v1/prompt-lint``, the admin API), shared by replicas through Redis when
they have one (``gateway.near_miss_findings``). Invalidate, purge and delete forget a tenant here and
in Redis (``forget_tenant``); other replicas forget it when their policies show its new epoch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import blake3
import numpy as np

from gateway.embedding import EMBEDDING_DIM, PromptEmbedder
from gateway.metrics import GatewayMetrics
from gateway.model import ModelRuntime
from gateway.near_miss_findings import DivergingSpan, LocalFindings, RedisFindings
from gateway.routing import KVAwareRouter, RouteRequest, WorkerLoad
from policies.hashing import NamespaceSegment
from policies.isolation import GLOBAL_NAMESPACE_ID
from policies.near_miss import SegmentLayout, layout_of, reusable
from tenancy.policy import TenantPolicy


class PolicySource(Protocol):
    """What near miss reads of the tenant policies in force (``tenancy.cache.PolicyCache``)."""

    @property
    def ready(self) -> bool: ...

    def get(self, tenant_id: str) -> TenantPolicy | None: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Remembered:
    token_ids: np.ndarray  # int32, the prompt's first ``max_prompt_tokens`` tokens
    layout: SegmentLayout  # its namespace segments (start token, key)
    worker_url: str
    own_key: bytes  # the key it is indexed under (its last segment's)
    tenant_id: str  # whose prompt it is: every `shared` tenant's key is the global one
    epoch: int = 0  # its tenant's epoch when it was prepared (older than the newest: purged since)


class NamespaceVectors:
    """One namespace key's remembered prompts: a FAISS inner-product index over unit vectors."""

    def __init__(self, dim: int, capacity: int) -> None:
        import faiss  # only when a tenant enables near-miss

        self._index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        self._entries: OrderedDict[int, Remembered] = OrderedDict()
        self._id_of: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        self._next_id = 0
        self._capacity = capacity

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, vector: np.ndarray, entry: Remembered) -> None:
        digest = blake3.blake3(
            entry.token_ids.tobytes() + entry.worker_url.encode() + b"\0" + entry.tenant_id.encode()
        ).digest(16)
        known = self._id_of.get(digest)
        if known is not None:  # the same tenant's prompt on the same worker: just keep it fresh
            self._entries.move_to_end(known)
            return
        entry_id, self._next_id = self._next_id, self._next_id + 1
        self._index.add_with_ids(vector.reshape(1, -1), np.array([entry_id], dtype=np.int64))
        self._entries[entry_id], self._id_of[digest], self._digest_of[entry_id] = entry, entry_id, digest
        if len(self._entries) > self._capacity:
            oldest, _ = self._entries.popitem(last=False)
            del self._id_of[self._digest_of.pop(oldest)]
            self._index.remove_ids(np.array([oldest], dtype=np.int64))

    def num_of(self, tenant_id: str) -> int:
        return sum(1 for entry in self._entries.values() if entry.tenant_id == tenant_id)

    def remove_tenant(self, tenant_id: str) -> None:
        """Drop one tenant's prompts (a `shared` tenant's, from the global key's index)."""
        gone = [entry_id for entry_id, entry in self._entries.items() if entry.tenant_id == tenant_id]
        for entry_id in gone:
            del self._entries[entry_id]
            del self._id_of[self._digest_of.pop(entry_id)]
        if gone:
            self._index.remove_ids(np.array(gone, dtype=np.int64))

    def search(self, vector: np.ndarray, k: int) -> list[tuple[float, Remembered]]:
        if not self._entries:
            return []
        scores, ids = self._index.search(vector.reshape(1, -1), min(k, len(self._entries)))
        return [(float(s), self._entries[int(i)]) for s, i in zip(scores[0], ids[0], strict=True) if i >= 0]


@dataclass(frozen=True, kw_only=True, slots=True)
class NearMissRoute:
    worker_url: str
    exact_tokens: int | None  # None: the exact route stood; else the exact index's cached tokens there


class NearMissRouting:
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
    ) -> None:
        """``findings``: a ``LocalFindings`` or ``RedisFindings`` store (default: this replica's own).
        ``policies``: the tenant policies in force (``tenancy.cache.PolicyCache``); every ``sweep_s``
        the tenants whose epoch moved or who were deleted, through any replica, are forgotten here."""
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
        self._pool_keys: set[bytes] = set()  # keys of the common pool (one per namespace secret)
        self._background: set[asyncio.Task] = set()
        self._policies = policies
        self._sweep_s = sweep_s
        self._sweeper: asyncio.Task | None = None

    # ---- the routing decision ------------------------------------------------------------------
    async def route(
        self,
        tenant: TenantPolicy,
        model: ModelRuntime,
        token_ids: Sequence[int],
        segments: Sequence[NamespaceSegment],
        request: RouteRequest,
        exact_url: str,
    ) -> NearMissRoute:
        """The worker for this request: ``exact_url`` unless a verified near miss beats it."""
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
        best = self._best(tokens, segments, nominees, by_url, request.block_size)
        vector, late = None, False
        if (best is None or best[0] < self.min_blocks) and self._searchable(model.model_id, segments):
            vector = await self._embed_within_bound(head, tenant.tenant_id)
            if self._stale(tenant.tenant_id, tenant.epoch):  # purged while it waited: remember nothing
                return NearMissRoute(worker_url=exact_url, exact_tokens=None)
            late = vector is None and self.max_wait_s > 0
            if vector is not None:
                found = [entry for _, entry in self._search(model.model_id, segments, vector)]
                nominees += found
                better = self._best(tokens, segments, found, by_url, request.block_size)
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

    async def _embed_within_bound(self, head: str, tenant_id: str) -> np.ndarray | None:
        """The head's embedding, ahead of queued background ones; None if not ready within the bound
        (with no bound, only an embedding already at hand: the request never waits)."""
        vector = self.embedder.cached(head, tenant=tenant_id)
        if vector is not None or self.max_wait_s <= 0:
            return vector
        started = time.perf_counter()
        job = asyncio.ensure_future(self.embedder.embed(head, urgent=True, tenant=tenant_id))
        try:
            return await asyncio.wait_for(asyncio.shield(job), self.max_wait_s)
        except TimeoutError:  # the job goes on: its vector lands in the LRU for _remember
            return None
        finally:
            if self._metrics is not None:
                self._metrics.near_miss_embed_seconds.observe(time.perf_counter() - started)

    def _best(
        self,
        tokens: np.ndarray,
        segments: Sequence[NamespaceSegment],
        nominees: Sequence[Remembered],
        by_url: dict,
        block_size: int,
    ) -> tuple[int, Remembered] | None:
        """The nominee whose cache the request could reuse most (exact tokens, same keys), if any."""
        layout = layout_of(segments)
        best: tuple[int, Remembered] | None = None
        for entry in nominees:
            if entry.worker_url not in by_url:
                continue  # its worker is gone
            blocks = reusable(tokens, layout, entry.token_ids, entry.layout, block_size).reusable_blocks
            if blocks and (best is None or blocks > best[0]):
                best = (blocks, entry)
        return best

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
        if segments[-1].namespace_id == GLOBAL_NAMESPACE_ID:
            self._pool_keys.add(own_key)
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
        )
        recent = self._recent.get((model.model_id, own_key))
        if recent is None:
            recent = self._recent[(model.model_id, own_key)] = deque(maxlen=self.recent_per_namespace)
        recent.append(entry)
        if vector is None and head:
            vector = self.embedder.cached(head, tenant=tenant.tenant_id)
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
        """Keep where the request parted from its closest prompt of the same tenant and namespace (one per
        request). Never another tenant's: a finding shows the other prompt's text, and every `shared`
        tenant's key is the global one."""
        own_key, layout = bytes(segments[-1].key), layout_of(segments)
        if self._stale(tenant.tenant_id, tenant.epoch):  # its tenant was purged after it was prepared
            return
        closest: tuple[int, Remembered] | None = None
        for entry in nominees:
            if entry.own_key == own_key and entry.tenant_id == tenant.tenant_id:
                lcp = reusable(tokens, layout, entry.token_ids, entry.layout, block_size).lcp_tokens
                if closest is None or lcp > closest[0]:
                    closest = (lcp, entry)
        if closest is None:
            return
        lcp, other = closest
        if lcp >= min(len(tokens), len(other.token_ids)) or lcp == 0:
            return  # one is a prefix of the other (no divergence) or nothing is shared
        span = DivergingSpan(
            model_id=model.model_id,
            position_token=lcp,
            before_text=model.decode(tokens[max(0, lcp - 8) : lcp].tolist()),
            request_text=model.decode(tokens[lcp : lcp + 12].tolist()),
            other_text=model.decode(other.token_ids[lcp : lcp + 12].tolist()),
            tokens_after=int(len(tokens) - lcp),
            seen_at=time.time(),
        )
        self._spawn(self._findings.record(tenant.tenant_id, span))  # Redis, if any, stays off the path

    async def findings(self, tenant_id: str) -> list[dict[str, Any]]:
        """The tenant's recent diverging spans (every replica's, with Redis), newest first."""
        return await self._findings.recent(tenant_id)

    async def forget_tenant(self, tenant_id: str, *, epoch: int | None = None) -> None:
        """Drop everything remembered of a tenant: its prompts, vectors and findings, here and in Redis.

        Called by the admin purge, invalidate and delete with the tenant's new ``epoch``: whatever is
        still on its way from an older one (a request prepared before, a background embedding) is kept
        out. None: the epoch moved past the newest seen here. Other replicas drop their own copies when
        they see the tenant's new epoch (``_observe_epoch``)."""
        known = self._epoch_of.get(tenant_id)
        if epoch is None and known is not None:
            epoch = known + 1
        if epoch is not None:
            self._epoch_of[tenant_id] = max(epoch, known if known is not None else epoch)
        self._forget_local(tenant_id)
        await self._findings.forget(tenant_id)

    def _stale(self, tenant_id: str, epoch: int) -> bool:
        """Whether something prepared at ``epoch`` is from before the tenant's latest purge, or its
        tenant was deleted or opted out since (the policies in force: nothing is kept per deletion)."""
        known = self._epoch_of.get(tenant_id)
        if known is not None and epoch < known:
            return True
        if self._policies is None or not self._policies.ready:
            return False
        current = self._policies.get(tenant_id)
        return current is None or not current.near_miss_routing or epoch < current.epoch

    def _observe_epoch(self, tenant: TenantPolicy) -> None:
        """A tenant whose epoch grew since its prompts were remembered was purged or invalidated
        through some replica: its old prompts can never be reused (their keys are gone), so drop them.
        (A request still carrying an older epoch changes nothing: ``_stale`` keeps it out.)"""
        known = self._epoch_of.get(tenant.tenant_id)
        if known is not None and tenant.epoch > known:
            self._forget_local(tenant.tenant_id)
        self._epoch_of[tenant.tenant_id] = max(tenant.epoch, known if known is not None else tenant.epoch)

    def _forget_local(self, tenant_id: str) -> None:
        for pair in self._keys_of.pop(tenant_id, ()):
            if pair[1] in self._pool_keys:  # the shared pool's key stays: drop this tenant's prompts
                self._forget_shared(pair, tenant_id)
                continue
            self._recent.pop(pair, None)
            self._vectors.pop(pair, None)
        self._findings.forget_local(tenant_id)

    def _forget_shared(self, pair: tuple[str, bytes], tenant_id: str) -> None:
        recent = self._recent.get(pair)
        if recent is not None:
            kept = [entry for entry in recent if entry.tenant_id != tenant_id]
            self._recent[pair] = deque(kept, maxlen=recent.maxlen)
        vectors = self._vectors.get(pair)
        if vectors is not None:
            vectors.remove_tenant(tenant_id)

    def sweep(self) -> None:
        """Forget the remembered tenants whose epoch moved, who opted out or who were deleted."""
        if self._policies is None or not self._policies.ready:
            return
        for tenant_id in list(self._epoch_of):
            tenant = self._policies.get(tenant_id)
            if tenant is None or not tenant.near_miss_routing:  # deleted, or opted out
                self._forget_local(tenant_id)
                del self._epoch_of[tenant_id]
            else:
                self._observe_epoch(tenant)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_s)
            self.sweep()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._background:
            await asyncio.wait(self._background, timeout=2)
        self.embedder.close()
        await self._findings.close()
