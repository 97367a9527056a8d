"""Hot-prefix promotion: count message-boundary prefixes across tenants, promote the popular ones.

A *boundary prefix* is the prompt up to a message boundary (end of the system prompt, of the tools,
of each document message before the last user turn), floored to whole KV blocks and identified by
its *global-form hash*: the chained block hash (``policies.hashing``) of its tokens under the constant
``isolation.PROMOTION_IDENTITY_KEY`` (not the promoted pool's KV key, which changes with the namespace
secret: promotions outlive a rotation). Hits are counted per hash in a sliding one-hour
window, together with the distinct tenants that sent it. A prefix is promoted when it has at least
``min_hits_per_hour`` hits **and** at least ``min_tenants`` distinct tenants (never fewer than 3),
each tenant's hits counting only up to ``min_hits_per_hour / min_tenants``. Promoted, it is hashed in
the promoted namespace for every opted-in tenant
(``isolation.namespace_segments(promoted_prefix_tokens=…)``), so they share one copy of its KV cache.

Privacy. A tenant's private prompt is seen from one tenant only, so it can never be promoted however
often it is sent; and a tenant cannot learn by timing whether another tenant sent some text unless
that text is already common to ``min_tenants`` tenants. Counters hold only opaque tenant tags (pass
``isolation.tenant_namespace_id``, never a tenant id), expose only counts (``PrefixStats`` has no
tenant list), and keep at most ``max_tenants`` tags per prefix. Tenants who have not opted in
(``share_hot_prefixes`` false) and ``dedicated`` tenants neither feed the counters nor read
promotions (``hot_prefix_access``). Tenants are created by admins, so one party cannot mint the
distinct tenants a promotion needs. Only served requests are counted (``observe`` runs after the
worker answered), and the gateway tells a tenant about a promotion (``promoted_prefix_tokens``) only
if it was counted for that prefix before the promotion. What remains (a party holding k−1 opted-in
tenants can still infer that others sent a prefix often) is documented in docs/security.md.

Counters sit behind the async ``PromotionCounter`` protocol: ``InMemoryPromotionCounter`` for one
gateway; a Redis-backed one (gateway/) lets replicas share them. Time is always passed in.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NewType, Protocol

from policies.hashing import NamespaceSegment, block_hashes
from policies.isolation import ISOLATION_LEVELS, PROMOTED_NAMESPACE_ID, PROMOTION_IDENTITY_KEY

PrefixHash = NewType("PrefixHash", str)  # hex of the global-form hash of a prefix's last block
TenantTag = NewType("TenantTag", str)  # opaque, stable tag of a tenant (its namespace id)

HOUR_S = 3600.0
ENV_MIN_HITS = "PREFIXGATE_PROMOTION_MIN_HITS"
ENV_MIN_TENANTS = "PREFIXGATE_PROMOTION_MIN_TENANTS"
DEFAULT_MIN_HITS = 1000
DEFAULT_MIN_TENANTS = 3
MIN_TENANTS_FLOOR = 3  # k: one tenant's prompt is never shared, whatever the configuration says


def hot_prefix_access(isolation_level: str, share_hot_prefixes: bool) -> bool:
    """Whether a tenant feeds the hot-prefix counters and reads promoted prefixes.

    Only tenants that opted in (``share_hot_prefixes``) and whose isolation level allows it
    (not ``dedicated``) do; the same answer holds for feeding and reading.
    """
    return share_hot_prefixes and ISOLATION_LEVELS[isolation_level].may_share_hot_prefixes


@dataclass(frozen=True, kw_only=True, slots=True)
class BoundaryPrefix:
    """One block-aligned message-boundary prefix of a request."""

    prefix_hash: PrefixHash
    num_tokens: int  # a positive multiple of the block size


def boundary_prefixes(
    token_ids: Sequence[int],
    boundary_token_offsets: Iterable[int | None],
    *,
    block_size: int,
    model_fingerprint: bytes,
) -> list[BoundaryPrefix]:
    """The request's boundary prefixes, shortest first, one per distinct block-aligned length.

    Args:
        token_ids: the prompt's tokens (as sent to the worker).
        boundary_token_offsets: token offsets of message boundaries (``chat_text.char_to_token_offsets``
            of ``message_boundary_positions``); None entries and offsets past the prompt are skipped.
            Each is floored to a whole number of blocks; boundaries inside the first block give nothing.
        block_size, model_fingerprint: as the worker hashes (``/v1/info``).
    """
    lengths = sorted(
        {
            o // block_size * block_size
            for o in boundary_token_offsets
            if o is not None and o <= len(token_ids)
        }
        - {0}
    )
    if not lengths:
        return []
    segment = NamespaceSegment(start_token=0, namespace_id=PROMOTED_NAMESPACE_ID, key=PROMOTION_IDENTITY_KEY)
    hashes = block_hashes(
        token_ids, block_size, model_fingerprint, [segment], max_blocks=lengths[-1] // block_size
    )
    return [
        BoundaryPrefix(prefix_hash=PrefixHash(hashes[n // block_size - 1].hex()), num_tokens=n)
        for n in lengths
    ]


def longest_promoted_prefix(prefixes: Sequence[BoundaryPrefix], promoted: Container[PrefixHash]) -> int:
    """Tokens of the request's longest promoted prefix (0 if none): ``promoted_prefix_tokens``."""
    return max((p.num_tokens for p in prefixes if p.prefix_hash in promoted), default=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class PrefixStats:
    """Counts for one prefix in the sliding window. Never says which tenants."""

    prefix_hash: PrefixHash
    hits: int  # hits inside the window
    num_tenants: int  # distinct tenants inside the window, at most the counter's tenant cap
    window_s: float = HOUR_S

    @property
    def hits_per_hour(self) -> float:
        return self.hits * HOUR_S / self.window_s


@dataclass(frozen=True, kw_only=True, slots=True)
class PromotedPrefix:
    """A promotion, as stored in SQL and listed to admins (no tenants, no text)."""

    prefix_hash: PrefixHash
    num_tokens: int
    hits_per_hour: int  # at promotion time
    num_tenants: int  # at promotion time
    promoted_at: float  # seconds since the epoch, from the caller's clock

    def to_json(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, kw_only=True, slots=True)
class PromotionPolicy:
    """The promotion thresholds. ``min_tenants`` below ``MIN_TENANTS_FLOOR`` (3) is raised to it."""

    min_hits_per_hour: int = DEFAULT_MIN_HITS
    min_tenants: int = DEFAULT_MIN_TENANTS

    def __post_init__(self) -> None:
        if self.min_hits_per_hour < 1:
            raise ValueError("min_hits_per_hour must be at least 1")
        object.__setattr__(self, "min_tenants", max(self.min_tenants, MIN_TENANTS_FLOOR))

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> PromotionPolicy:
        """From ``PREFIXGATE_PROMOTION_MIN_HITS`` / ``…_MIN_TENANTS`` in ``env`` (e.g. os.environ)."""
        try:
            policy = cls(
                min_hits_per_hour=int(env.get(ENV_MIN_HITS, DEFAULT_MIN_HITS)),
                min_tenants=int(env.get(ENV_MIN_TENANTS, DEFAULT_MIN_TENANTS)),
            )
        except ValueError as exc:
            raise ValueError(f"{ENV_MIN_HITS} and {ENV_MIN_TENANTS} must be integers: {exc}") from None
        policy.check_threshold()
        return policy

    def check_threshold(self) -> None:
        """Raise ValueError unless ``k − 1`` tenants at their cap stay below the threshold: else one party's
        k−1 tenants make the hits alone and a single request of a victim, the k-th tenant, completes a
        promotion, telling the party that the victim sent the prefix (review r3, D5: (9, 4)). ``k``
        tenants at their cap always reach it (the cap is rounded up). Deployment configuration is checked;
        tests may still build eager policies."""
        cap = hits_cap(self.max_hits_per_tenant_per_hour, HOUR_S) or 0
        if (self.min_tenants - 1) * cap >= self.min_hits_per_hour:
            raise ValueError(
                f"{ENV_MIN_HITS} ({self.min_hits_per_hour}) is too low for {ENV_MIN_TENANTS} "
                f"({self.min_tenants}, never below {MIN_TENANTS_FLOOR}): each tenant counts at most "
                f"ceil(min_hits / min_tenants) = {cap} hits, and {self.min_tenants - 1} tenants at that "
                "cap would make the threshold alone"
            )

    @property
    def max_hits_per_tenant_per_hour(self) -> float:
        """A tenant's share of the hits: k−1 tenants of one party never reach the threshold alone."""
        return self.min_hits_per_hour / self.min_tenants

    def should_promote(self, stats: PrefixStats) -> bool:
        return stats.hits_per_hour >= self.min_hits_per_hour and stats.num_tenants >= self.min_tenants


def promotion_candidates(
    policy: PromotionPolicy,
    prefixes: Sequence[BoundaryPrefix],
    stats: Sequence[PrefixStats],
    *,
    known: Container[PrefixHash],
    now: float,
) -> list[PromotedPrefix]:
    """Prefixes that just qualify and are not ``known`` (already promoted, or revoked by an admin:
    a revoked prefix stays known so it is not promoted straight back)."""
    return [
        PromotedPrefix(
            prefix_hash=prefix.prefix_hash,
            num_tokens=prefix.num_tokens,
            hits_per_hour=int(s.hits_per_hour),
            num_tenants=s.num_tenants,
            promoted_at=now,
        )
        for prefix, s in zip(prefixes, stats, strict=True)
        if prefix.prefix_hash not in known and policy.should_promote(s)
    ]


class PromotionCounter(Protocol):
    """Hit counters shared by the gateways that see a tenant population (memory or Redis).

    Each tenant's hits count at most ``max_hits_per_tenant_per_hour`` (scaled to the window): a few
    tenants of one party cannot make up the hits that the other tenants would have to send.
    """

    async def record(
        self,
        prefix_hashes: Sequence[PrefixHash],
        tenant_tag: TenantTag,
        now: float,
        *,
        max_hits_per_tenant_per_hour: float | None = None,
    ) -> list[PrefixStats]:
        """Count one hit from ``tenant_tag`` on each prefix; return their (capped) stats after it."""
        ...

    async def counted(
        self,
        prefix_hash: PrefixHash,
        now: float,
        *,
        among: Container[TenantTag],
        max_hits_per_tenant_per_hour: float | None = None,
    ) -> tuple[PrefixStats, frozenset[TenantTag]]:
        """A prefix's (capped) stats in the window counting only the tenants in ``among`` (those still
        opted in), and their opaque tags (to decide who may be told of its promotion; never shown)."""
        ...

    async def forget(self, prefix_hash: PrefixHash) -> None:
        """Drop a prefix's counts (after an admin revokes its promotion)."""
        ...


def hits_cap(max_hits_per_tenant_per_hour: float | None, window_s: float) -> int | None:
    """A tenant's hit allowance inside a window of ``window_s``, None for no cap.

    Rounded up, so that ``k`` tenants at their cap reach the threshold; ``check_threshold`` refuses the
    thresholds at which ``k − 1`` tenants at their cap would reach it alone.
    Shared by the memory and Redis counters.
    """
    if max_hits_per_tenant_per_hour is None:
        return None
    return max(1, math.ceil(max_hits_per_tenant_per_hour * window_s / HOUR_S))


async def observe(
    counter: PromotionCounter,
    policy: PromotionPolicy,
    prefixes: Sequence[BoundaryPrefix],
    tenant_tag: TenantTag,
    now: float,
    *,
    known: Container[PrefixHash] = frozenset(),
) -> list[PromotedPrefix]:
    """Record one *served* request of an opted-in tenant; return the promotions it triggers.

    Call only when ``hot_prefix_access`` is true, and only once the request was served (a request the
    worker refuses must not pad the counts). Counter errors propagate: the caller skips promotion for
    the request (a Redis outage pauses promotion and leaves the request alone).
    """
    if not prefixes:
        return []
    stats = await counter.record(
        [p.prefix_hash for p in prefixes],
        tenant_tag,
        now,
        max_hits_per_tenant_per_hour=policy.max_hits_per_tenant_per_hour,
    )
    return promotion_candidates(policy, prefixes, stats, known=known, now=now)


@dataclass(slots=True)
class _Counts:
    """Per-prefix window state."""

    tenant_bucket_hits: dict[str, dict[int, int]]  # tenant tag → bucket index → hits (≤ max_tenants tags)


class SlidingWindowCounter:
    """In-memory, bounded sliding-window counter (synchronous, pure state; no clock of its own).

    Memory bound: at most ``max_prefixes`` prefixes (least recently seen dropped first), each with at
    most ``max_tenants`` tenant tags of at most ``window_s / bucket_s`` buckets. The window is bucketed:
    a hit counts for between ``window_s - bucket_s`` and ``window_s`` seconds.
    """

    def __init__(
        self,
        *,
        window_s: float = HOUR_S,
        bucket_s: float = 60.0,
        max_tenants: int = 64,
        max_prefixes: int = 10_000,
    ) -> None:
        if bucket_s <= 0 or window_s < bucket_s:
            raise ValueError("need 0 < bucket_s <= window_s")
        if max_tenants < MIN_TENANTS_FLOOR or max_prefixes < 1:
            raise ValueError(f"max_tenants must be at least {MIN_TENANTS_FLOOR} and max_prefixes positive")
        self.window_s = window_s
        self.bucket_s = bucket_s
        self.num_buckets = int(window_s // bucket_s)
        self.max_tenants = max_tenants
        self.max_prefixes = max_prefixes
        self._counts: OrderedDict[PrefixHash, _Counts] = OrderedDict()

    def __len__(self) -> int:
        return len(self._counts)

    def record(
        self,
        prefix_hash: PrefixHash,
        tenant_tag: TenantTag,
        now: float,
        *,
        max_hits_per_tenant: int | None = None,
    ) -> PrefixStats:
        """Count one hit from ``tenant_tag``; return the stats including it (each tenant's hits
        capped at ``max_hits_per_tenant`` within the window)."""
        bucket = self._bucket(now)
        counts = self._counts.get(prefix_hash)
        if counts is None:
            if len(self._counts) >= self.max_prefixes:
                self._counts.popitem(last=False)
            counts = self._counts[prefix_hash] = _Counts(tenant_bucket_hits={})
        else:
            self._counts.move_to_end(prefix_hash)
        self._expire(counts, bucket)
        tenants = counts.tenant_bucket_hits
        if tenant_tag not in tenants and len(tenants) >= self.max_tenants:
            # forget the least recently seen (ties: the smallest tag, as Redis's ZPOPMIN does)
            del tenants[min(tenants, key=lambda t: (max(tenants[t]), t))]
        buckets = tenants.setdefault(tenant_tag, {})
        buckets[bucket] = buckets.get(bucket, 0) + 1
        return self._stats(prefix_hash, counts.tenant_bucket_hits.values(), max_hits_per_tenant)

    def stats(
        self, prefix_hash: PrefixHash, now: float, *, max_hits_per_tenant: int | None = None
    ) -> PrefixStats:
        """Stats at ``now`` without counting a hit (zeros for an unknown prefix)."""
        counts = self._counts.get(prefix_hash)
        if counts is None:
            return PrefixStats(prefix_hash=prefix_hash, hits=0, num_tenants=0, window_s=self.window_s)
        self._expire(counts, self._bucket(now))
        return self._stats(prefix_hash, counts.tenant_bucket_hits.values(), max_hits_per_tenant)

    def counted(
        self,
        prefix_hash: PrefixHash,
        now: float,
        *,
        among: Container[TenantTag],
        max_hits_per_tenant: int | None = None,
    ) -> tuple[PrefixStats, frozenset[TenantTag]]:
        """Stats at ``now`` of the tenants in ``among`` only, and their tags (no hit counted)."""
        counts = self._counts.get(prefix_hash)
        if counts is None:
            return self._stats(prefix_hash, [], max_hits_per_tenant), frozenset()
        self._expire(counts, self._bucket(now))
        kept = {tag: b for tag, b in counts.tenant_bucket_hits.items() if TenantTag(tag) in among}
        return self._stats(prefix_hash, kept.values(), max_hits_per_tenant), frozenset(map(TenantTag, kept))

    def forget(self, prefix_hash: PrefixHash) -> None:
        self._counts.pop(prefix_hash, None)

    def _bucket(self, now: float) -> int:
        return int(now // self.bucket_s)

    def _expire(self, counts: _Counts, bucket: int) -> None:
        oldest = bucket - self.num_buckets  # this bucket and older are out of the window
        tenants = counts.tenant_bucket_hits
        for tag in list(tenants):
            buckets = tenants[tag]
            for b in [b for b in buckets if b <= oldest]:
                del buckets[b]
            if not buckets:
                del tenants[tag]

    def _stats(
        self, prefix_hash: PrefixHash, tenants: Iterable[dict[int, int]], cap: int | None
    ) -> PrefixStats:
        per_tenant = [sum(buckets.values()) for buckets in tenants]
        return PrefixStats(
            prefix_hash=prefix_hash,
            hits=sum(n if cap is None else min(n, cap) for n in per_tenant),
            num_tenants=len(per_tenant),
            window_s=self.num_buckets * self.bucket_s,
        )


class InMemoryPromotionCounter:
    """``PromotionCounter`` for a single gateway, over a ``SlidingWindowCounter``."""

    def __init__(self, window: SlidingWindowCounter | None = None) -> None:
        # Not `window or …`: an empty counter has len() 0, so a configured window would be dropped.
        self.window = window if window is not None else SlidingWindowCounter()

    async def record(
        self,
        prefix_hashes: Sequence[PrefixHash],
        tenant_tag: TenantTag,
        now: float,
        *,
        max_hits_per_tenant_per_hour: float | None = None,
    ) -> list[PrefixStats]:
        cap = hits_cap(max_hits_per_tenant_per_hour, self.window.num_buckets * self.window.bucket_s)
        return [self.window.record(h, tenant_tag, now, max_hits_per_tenant=cap) for h in prefix_hashes]

    async def stats(self, prefix_hashes: Sequence[PrefixHash], now: float) -> list[PrefixStats]:
        return [self.window.stats(h, now) for h in prefix_hashes]

    async def counted(
        self,
        prefix_hash: PrefixHash,
        now: float,
        *,
        among: Container[TenantTag],
        max_hits_per_tenant_per_hour: float | None = None,
    ) -> tuple[PrefixStats, frozenset[TenantTag]]:
        cap = hits_cap(max_hits_per_tenant_per_hour, self.window.num_buckets * self.window.bucket_s)
        return self.window.counted(prefix_hash, now, among=among, max_hits_per_tenant=cap)

    async def forget(self, prefix_hash: PrefixHash) -> None:
        self.window.forget(prefix_hash)
