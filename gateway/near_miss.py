"""Near-miss routing: when the exact KV index finds little, route to a worker holding a similar prompt.

For tenants that enable it (``near_miss_routing``), every routed prompt is remembered per namespace
key: its head's embedding in a FAISS inner-product index, its tokens and the worker it went to. When
the exact index finds fewer than ``min_blocks`` cached blocks on every worker, the head is embedded
(``gateway.embedding``, in its own thread) and the nearest remembered prompts of the request's own
namespace keys (its tenant key, plus the global key when its prefix is promoted) are nominated. Each
nominee is verified on tokens (``policies.near_miss``): only the blocks the two prompts share exactly,
under the same keys, count; the request goes to the nominee's worker if that beats the exact route.
Embeddings never decide reuse, and an index is keyed by namespace *key*, so no search ever sees another
tenant's prompts (nor this tenant's prompts of an earlier epoch).

The diverging span of a near miss (where the two prompts part) is kept per tenant as a candidate
canonicalization rule (``/v1/prompt-lint``, the admin API).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np

from gateway.embedding import EMBEDDING_DIM, PromptEmbedder
from gateway.metrics import GatewayMetrics
from gateway.model import ModelRuntime
from gateway.routing import RouteRequest
from policies.hashing import NamespaceSegment
from policies.near_miss import SegmentLayout, layout_of, reusable
from tenancy.policy import TenantPolicy


@dataclass(frozen=True, kw_only=True, slots=True)
class Remembered:
    token_ids: np.ndarray  # int32, the prompt's first ``max_prompt_tokens`` tokens
    layout: SegmentLayout  # its namespace segments (start token, key)
    worker_url: str
    own_key: bytes  # the key it is indexed under (its last segment's)


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
        digest = blake3.blake3(entry.token_ids.tobytes() + entry.worker_url.encode()).digest(16)
        known = self._id_of.get(digest)
        if known is not None:  # the same prompt on the same worker: just keep it fresh
            self._entries.move_to_end(known)
            return
        entry_id, self._next_id = self._next_id, self._next_id + 1
        self._index.add_with_ids(vector.reshape(1, -1), np.array([entry_id], dtype=np.int64))
        self._entries[entry_id], self._id_of[digest], self._digest_of[entry_id] = entry, entry_id, digest
        if len(self._entries) > self._capacity:
            oldest, _ = self._entries.popitem(last=False)
            del self._id_of[self._digest_of.pop(oldest)]
            self._index.remove_ids(np.array([oldest], dtype=np.int64))

    def search(self, vector: np.ndarray, k: int) -> list[tuple[float, Remembered]]:
        if not self._entries:
            return []
        scores, ids = self._index.search(vector.reshape(1, -1), min(k, len(self._entries)))
        return [(float(s), self._entries[int(i)]) for s, i in zip(scores[0], ids[0], strict=True) if i >= 0]


@dataclass(frozen=True, kw_only=True, slots=True)
class NearMissRoute:
    worker_url: str
    exact_tokens: int | None  # None: the exact route stood; else the exact index's cached tokens there


@dataclass(frozen=True, kw_only=True, slots=True)
class DivergingSpan:
    """Where a prompt parted from a similar one of the same tenant: a canonicalization candidate."""

    model_id: str
    position_token: int  # first token that differs
    before_text: str  # a few tokens before it (shared)
    request_text: str  # the request's tokens from there
    other_text: str  # the similar prompt's tokens from there
    tokens_after: int  # tokens after the divergence that could not be reused
    seen_at: float  # unix time

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model_id,
            "position_token": self.position_token,
            "before": self.before_text,
            "request": self.request_text,
            "other": self.other_text,
            "tokens_after_divergence": self.tokens_after,
            "suggestion": "if this span varies per request (an id, a date, a counter), move it after the "
            "shared prefix or add a canonicalization pattern for it",
            "seen_at": self.seen_at,
        }


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
        max_pending_embeddings: int = 32,
        findings_per_tenant: int = 20,
    ) -> None:
        self.embedder = embedder
        self._metrics = metrics
        self.min_blocks = min_blocks
        self.head_tokens = head_tokens
        self.top_k = top_k
        self.max_prompt_tokens = max_prompt_tokens
        self._capacity = capacity_per_namespace
        self._max_pending = max_pending_embeddings
        self._findings_per_tenant = findings_per_tenant
        self._vectors: dict[tuple[str, bytes], NamespaceVectors] = {}
        self._findings: dict[str, deque[DivergingSpan]] = {}
        self._background: set[asyncio.Task] = set()

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
        by_url = {worker.url: worker for worker in request.candidates}
        tokens = np.asarray(token_ids[: self.max_prompt_tokens], dtype=np.int32)
        head = model.decode(token_ids[: self.head_tokens])
        if max(worker.cached_blocks for worker in request.candidates) >= self.min_blocks:
            self._remember_later(model, tokens, segments, exact_url, head)
            return NearMissRoute(worker_url=exact_url, exact_tokens=None)
        started = time.perf_counter()
        vector = await self.embedder.embed(head)
        if self._metrics is not None:
            self._metrics.near_miss_embed_seconds.observe(time.perf_counter() - started)
        layout = layout_of(segments)
        best: tuple[int, Remembered] | None = None
        for _, entry in self._search(model.model_id, segments, vector):
            if entry.worker_url not in by_url:
                continue  # its worker is gone
            reuse = reusable(tokens, layout, entry.token_ids, entry.layout, request.block_size)
            if entry.own_key == bytes(segments[-1].key):
                self._record_finding(tenant, model, tokens, entry, reuse.lcp_tokens)
            if reuse.reusable_blocks and (best is None or reuse.reusable_blocks > best[0]):
                best = (reuse.reusable_blocks, entry)
        chosen = exact_url
        exact_tokens: int | None = None
        if best is not None and best[0] > by_url[exact_url].cached_blocks:
            chosen = best[1].worker_url
            exact_tokens = by_url[chosen].cached_blocks * request.block_size
        if self._metrics is not None:
            self._metrics.near_miss_routes.labels("moved" if exact_tokens is not None else "kept").inc()
        self._add(model, tokens, segments, chosen, vector)
        return NearMissRoute(worker_url=chosen, exact_tokens=exact_tokens)

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
    def _add(
        self,
        model: ModelRuntime,
        tokens: np.ndarray,
        segments: Sequence[NamespaceSegment],
        url: str,
        vector: np.ndarray,
    ) -> None:
        own_key = bytes(segments[-1].key)
        vectors = self._vectors.get((model.model_id, own_key))
        if vectors is None:
            vectors = self._vectors[(model.model_id, own_key)] = NamespaceVectors(
                EMBEDDING_DIM, self._capacity
            )
        vectors.add(
            vector, Remembered(token_ids=tokens, layout=layout_of(segments), worker_url=url, own_key=own_key)
        )

    def _remember_later(
        self,
        model: ModelRuntime,
        tokens: np.ndarray,
        segments: Sequence[NamespaceSegment],
        url: str,
        head: str,
    ) -> None:
        """Index a prompt the exact route handled, off the request's path (shed when embeddings queue up)."""
        if self.embedder.pending >= self._max_pending:
            return

        async def remember() -> None:
            self._add(model, tokens, segments, url, await self.embedder.embed(head))

        task = asyncio.get_running_loop().create_task(remember())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- findings ------------------------------------------------------------------------------
    def _record_finding(
        self, tenant: TenantPolicy, model: ModelRuntime, tokens: np.ndarray, other: Remembered, lcp: int
    ) -> None:
        if lcp >= min(len(tokens), len(other.token_ids)) or lcp == 0:
            return  # one is a prefix of the other (no divergence) or nothing is shared
        findings = self._findings.setdefault(tenant.tenant_id, deque(maxlen=self._findings_per_tenant))
        if any(f.position_token == lcp and f.model_id == model.model_id for f in findings):
            return
        findings.append(
            DivergingSpan(
                model_id=model.model_id,
                position_token=lcp,
                before_text=model.decode(tokens[max(0, lcp - 8) : lcp].tolist()),
                request_text=model.decode(tokens[lcp : lcp + 12].tolist()),
                other_text=model.decode(other.token_ids[lcp : lcp + 12].tolist()),
                tokens_after=int(len(tokens) - lcp),
                seen_at=time.time(),
            )
        )

    def findings(self, tenant_id: str) -> list[dict[str, Any]]:
        """The tenant's recent diverging spans, newest first."""
        return [f.to_json() for f in reversed(self._findings.get(tenant_id, ()))]

    def forget_tenant(self, tenant_id: str) -> None:
        self._findings.pop(tenant_id, None)

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=2)
        self.embedder.close()
