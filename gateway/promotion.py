"""Hot-prefix promotion in the gateway: count, promote, and hash promoted prefixes globally.

For a request of a tenant with hot-prefix access (``policies.promotion.hot_prefix_access``: opted in
with ``share_hot_prefixes`` and not ``dedicated``), ``HotPrefixPromotion``:

1. finds the message-boundary prefixes of the (canonicalized) prompt: one marked render of the chat
   template locates the boundaries, the tokenizer's offsets turn them into token offsets, and
   ``boundary_prefixes`` hashes them in the global form;
2. answers the length of the longest promoted prefix (``match``), which the pipeline hashes in the
   promoted namespace (``namespace_segments(promoted_prefix_tokens=…)``), and what the tenant is told
   of it: nothing unless it was one of the tenants counted for that prefix when it was promoted;
3. once the worker has served the request (``served``), records one hit per prefix in the
   ``PromotionCounter`` (memory, or Redis shared by replicas) and promotes those that now pass the
   thresholds (``observe``). A promotion is in force on this replica at once and is written to SQL in
   the background (retried until it lands); the policy reload brings it to every other replica.

The request that completes the count is not served with the promotion and learns nothing of it;
the next opted-in tenant's request creates the promoted copy of the prefix's KV. A counter failure
(Redis down) pauses counting for ``pause_s``: promotions already in force keep working and
requests are unaffected.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

from gateway.metrics import GatewayMetrics
from gateway.model import ModelRuntime, TemplateError
from gateway.pipeline import CpuRunner, PromotionMatch, RenderedPrompt
from gateway.schemas import ChatRequest
from policies.chat_text import (
    char_to_token_offsets,
    insert_markers,
    locate_markers,
    message_boundary_positions,
)
from policies.isolation import tenant_namespace_id
from policies.promotion import (
    BoundaryPrefix,
    PrefixHash,
    PromotedPrefix,
    PromotionCounter,
    PromotionPolicy,
    TenantTag,
    boundary_prefixes,
    hot_prefix_access,
    observe,
)
from tenancy.cache import PolicyCache
from tenancy.hot_prefixes import HotPrefixRepository
from tenancy.policy import TenantPolicy

log = logging.getLogger(__name__)

PERSIST_RETRY_MAX_S = 30.0


@dataclass(frozen=True, slots=True)
class _Either:
    """Membership in either of two containers, without building their union on every request."""

    first: Container[PrefixHash]
    second: Container[PrefixHash]

    def __contains__(self, item: object) -> bool:
        return item in self.first or item in self.second


def prompt_boundary_prefixes(model: ModelRuntime, prompt: RenderedPrompt) -> list[BoundaryPrefix]:
    """The block-aligned message-boundary prefixes of a rendered chat prompt (none for completions,
    or when the chat template reacts to the position markers)."""
    request = prompt.request
    if not isinstance(request, ChatRequest) or prompt.text is None or prompt.encoding is None:
        return []
    messages = list(request.messages)
    positions = message_boundary_positions(messages)
    if not positions:
        return []
    try:
        marked = model.render_chat(insert_markers(messages, positions), request.tools)
    except TemplateError:
        return []
    chars = locate_markers(marked, prompt.text, len(positions))
    if chars is None:
        return []
    token_starts = [start for start, _ in prompt.encoding.offsets]
    return boundary_prefixes(
        prompt.token_ids,
        char_to_token_offsets(token_starts, chars),
        block_size=model.block_size,
        model_fingerprint=model.fingerprint,
    )


class HotPrefixPromotion:
    """``PromotionLookup`` that also feeds the counters and records promotions."""

    def __init__(
        self,
        *,
        counter: PromotionCounter,
        policy: PromotionPolicy,
        cache: PolicyCache,
        repository: HotPrefixRepository,
        salt: bytes,
        metrics: GatewayMetrics,
        store_text: bool = False,
        pause_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.counter = counter
        self.policy = policy
        self._cache = cache
        self._repository = repository
        self._salt = salt
        self._metrics = metrics
        self._store_text = store_text
        self._pause_s = pause_s
        self._clock = clock
        self._paused_until = 0.0  # time.monotonic()
        self._pending: dict[PrefixHash, PromotedPrefix] = {}  # promoted here, not yet in the snapshot
        self._tasks: set[asyncio.Task] = set()
        # Tenants counted for a prefix when this replica promoted it: the only ones told about it
        # (elsewhere, and after a restart, nobody is told; the promotion works all the same).
        self._contributors: dict[PrefixHash, frozenset[TenantTag]] = {}

    @property
    def paused(self) -> bool:
        return time.monotonic() < self._paused_until

    @property
    def promoted(self) -> Container[PrefixHash]:
        """Promotions in force on this replica: the SQL snapshot plus its own unsaved ones."""
        self._prune_pending()
        return _Either(self._cache.promoted_hashes, self._pending)

    def _prune_pending(self) -> None:
        """Once the snapshot knows a hash (saved here or by another replica, or revoked), it decides.
        Pruned here rather than after the write: a policy reload that started before the write may
        still land after it, and the promotion must not blink out in between."""
        if self._pending:
            known = self._cache.known_hashes
            for prefix_hash in [h for h in self._pending if h in known]:
                del self._pending[prefix_hash]

    async def match(
        self, tenant: TenantPolicy, model: ModelRuntime, prompt: RenderedPrompt, *, run_cpu: CpuRunner
    ) -> PromotionMatch:
        if not hot_prefix_access(tenant.isolation, tenant.share_hot_prefixes):
            return PromotionMatch()
        prefixes = await run_cpu(prompt_boundary_prefixes, model, prompt)
        if not prefixes:
            return PromotionMatch()
        promoted = self.promoted
        longest = max(
            (p for p in prefixes if p.prefix_hash in promoted), key=lambda p: p.num_tokens, default=None
        )
        if longest is None:
            return PromotionMatch(prefixes=tuple(prefixes))
        told = self._tag(tenant) in self._contributors.get(longest.prefix_hash, ())
        return PromotionMatch(
            promoted_prefix_tokens=longest.num_tokens,
            reported_prefix_tokens=longest.num_tokens if told else 0,
            prefixes=tuple(prefixes),
        )

    def served(
        self, tenant: TenantPolicy, model: ModelRuntime, match: PromotionMatch, token_ids: Sequence[int]
    ) -> None:
        """Count a served request (in the background: the answer is already on its way)."""
        if not match.prefixes or self.paused:
            return
        task = asyncio.get_running_loop().create_task(
            self._observe(self._tag(tenant), model, list(match.prefixes), list(token_ids))
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _tag(self, tenant: TenantPolicy) -> TenantTag:
        return TenantTag(tenant_namespace_id(self._salt, tenant.tenant_id))  # opaque, never the tenant id

    async def _observe(
        self, tag: TenantTag, model: ModelRuntime, prefixes: list[BoundaryPrefix], token_ids: list[int]
    ) -> None:
        known = _Either(self._cache.known_hashes, self._pending)
        now = self._clock()
        try:
            # Candidates on every counted hit (a superset), then decided on the live tenants alone.
            promotions = await observe(self.counter, self.policy, prefixes, tag, now, known=known)
            live = self._opted_in_tags() if promotions else frozenset()
            cap = self.policy.max_hits_per_tenant_per_hour
            counted = [
                await self.counter.counted(p.prefix_hash, now, among=live, max_hits_per_tenant_per_hour=cap)
                for p in promotions
            ]
        except Exception as exc:  # Redis down or slow: promotion pauses, requests go on
            self._metrics.promotion_errors.inc()
            if not self.paused:
                log.warning(
                    "hot-prefix counters unavailable, promotion paused for %.0fs: %s", self._pause_s, exc
                )
            self._paused_until = time.monotonic() + self._pause_s
            return
        for promotion, (stats, tags) in zip(promotions, counted, strict=True):
            # The counters keep a tenant's tag and hits for the window; only tenants opted in *now* make
            # up k and the hits (review r17 D6, r22: one that opted out or was deleted must not complete
            # a promotion), and the stored figures are theirs.
            if not self.policy.should_promote(stats):
                continue
            self._contributors[promotion.prefix_hash] = tags
            live_promotion = dataclasses.replace(
                promotion, hits_per_hour=int(stats.hits_per_hour), num_tenants=stats.num_tenants
            )
            self._promote(live_promotion, model, token_ids)

    def _opted_in_tags(self) -> frozenset[TenantTag]:
        """Tags of the tenants in the policy snapshot that have hot-prefix access at this moment."""
        return frozenset(
            self._tag(policy)
            for policy in self._cache.tenants().values()
            if hot_prefix_access(policy.isolation, policy.share_hot_prefixes)
        )

    def _promote(self, promotion: PromotedPrefix, model: ModelRuntime, token_ids: list[int]) -> None:
        self._pending[promotion.prefix_hash] = promotion
        self._metrics.promotions.inc()
        log.info(
            "promoted hot prefix %s: %d tokens, %d hits/hour from %d tenants",
            promotion.prefix_hash[:16],
            promotion.num_tokens,
            promotion.hits_per_hour,
            promotion.num_tenants,
        )
        text = model.decode(token_ids[: promotion.num_tokens]) if self._store_text else None
        task = asyncio.get_running_loop().create_task(self._persist(promotion, model.model_id, text))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _persist(self, promotion: PromotedPrefix, model_id: str, text: str | None) -> None:
        """Write the promotion to SQL (off the request path), retrying while the database is down; it
        stays in force here meanwhile. Another replica may have written it first: that is fine."""
        delay_s = 0.5
        while True:
            try:
                await self._repository.add(promotion, model=model_id, text=text)
                await self._cache.reload()
                return
            except Exception as exc:
                log.warning("could not store hot prefix %s yet: %s", promotion.prefix_hash[:16], exc)
                await asyncio.sleep(delay_s)
                delay_s = min(2 * delay_s, PERSIST_RETRY_MAX_S)

    async def forget(self, prefix_hash: PrefixHash) -> None:
        """Drop a revoked prefix's counts (best effort: it stays known, so it is never re-promoted)."""
        self._pending.pop(prefix_hash, None)
        self._contributors.pop(prefix_hash, None)
        try:
            await self.counter.forget(prefix_hash)
        except Exception as exc:
            log.warning("could not clear the counts of hot prefix %s: %s", prefix_hash[:16], exc)

    async def close(self, timeout_s: float = 2.0) -> None:
        """Give pending writes a moment, then stop retrying (they are re-proposed after a restart)."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout_s)
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
