"""Hit ratios of the multi-tenant workload with canonicalization and promotion on and off.

The synthetic multi-tenant workload (``bench.workloads``) is written out as chat requests
(``bench.chat_workload``), a share of applications put the current time into their system prompt,
and every setting (``canon=off|report|on`` × ``promotion=off|on`` × ``timestamps=<share>``) is replayed
the gateway's way (``bench.chat_replay``) through the eviction policies at each capacity and isolation
level, with the same cache replay as trace files (``bench.replay``, prefix mode by default).

Capacities given as fractions refer to the workload's own unique blocks: those of the plain replay (no
timestamps, canonicalization off, no promotion, ``namespace`` isolation). Every setting gets the same
absolute size, so settings compare at equal memory. Promotion thresholds scale with the trace (see
``promotion_policy``). The command line and the report are in ``bench.chat_cli``.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from rich.console import Console
from rich.progress import Progress

from bench.belady import replay_belady
from bench.chat_replay import (
    ChatRenderer,
    PreparedRequest,
    PromotionRun,
    PromotionSettings,
    hash_requests,
    hashed_partitions,
    prepare,
    promote,
)
from bench.chat_workload import ChatSpec, chat_workload
from bench.replay import HitCounts, ReplayRequest, replay, total
from bench.workloads import WorkloadSpec
from policies.eviction import DEFAULT_POLICY, make_policy
from policies.promotion import HOUR_S, PromotionPolicy


@dataclass(frozen=True, kw_only=True, slots=True)
class Setting:
    """One way of serving the workload."""

    canon: str  # canonicalization mode of every tenant
    promotion: bool
    timestamp_share: float  # share of applications that put the current time into their system prompt

    @property
    def name(self) -> str:
        promotion = "on" if self.promotion else "off"
        return f"timestamps={self.timestamp_share:g} canon={self.canon} promotion={promotion}"


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatSweep:
    """What to simulate."""

    workload: WorkloadSpec
    chat: ChatSpec  # its timestamp_share is set per setting
    settings: tuple[Setting, ...]
    policies: tuple[str, ...]
    capacities: tuple[float, ...] | None  # fractions of the plain replay's unique blocks
    capacity_blocks: tuple[int, ...] | None
    isolations: tuple[str, ...]
    mode: str  # replay mode (bench.replay.MODES)
    block_size: int  # tokens per KV block
    opt_in_share: float  # share of tenants with share_hot_prefixes on
    promotion_share: float  # min hits per hour as a share of the trace's requests per hour
    promotion_min_hits: int | None  # absolute threshold instead of the share
    promotion_min_tenants: int
    promotion_window_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatResult:
    """Hit ratios of one policy at one capacity for one setting and isolation level."""

    setting: str
    canon: str
    promotion: str  # on / off
    timestamp_share: float
    isolation: str
    policy: str
    capacity: float  # fraction of the plain replay's unique blocks
    capacity_blocks: int
    hit_ratio: float
    prefix_hit_ratio: float
    reused_tokens: int  # prefix-usable hits × block size: prefill the cache saved
    seconds: float


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayStats:
    """The stream of one (setting, isolation level), independent of the cache."""

    setting: str
    isolation: str
    num_requests: int
    timestamped_requests: int
    moved_fragments: int  # by canonicalization, over all requests
    prompt_tokens: int
    num_blocks: int  # full blocks requested
    unique_blocks: int
    unbounded_hit_ratio: float  # prefix-usable hit ratio of an infinite cache: 1 - unique / requested
    promotions: int
    promoted_requests: int  # requests served with a promoted prefix
    promoted_tokens: int
    fewest_promotion_senders: int | None  # fewest tenants that sent one of the promoted prefixes


def promotion_policy(sweep: ChatSweep, requests_per_hour: float) -> PromotionPolicy:
    """Thresholds for the trace: ``promotion_min_hits`` if given, else ``promotion_share`` of the trace's
    requests per hour (the production default, 1000 hits per hour, is 1 % of a 100k-request-per-hour
    gateway). The counters' window is ``promotion_window_s`` of trace time."""
    min_hits = sweep.promotion_min_hits or max(1, round(sweep.promotion_share * requests_per_hour))
    return PromotionPolicy(min_hits_per_hour=min_hits, min_tenants=sweep.promotion_min_tenants)


def opted_in_tenants(num_tenants: int, share: float) -> frozenset[str]:
    """The first ``round(share × n)`` tenants by index (popularity is independent of the index)."""
    return frozenset(f"t{i}" for i in range(round(share * num_tenants)))


def run_chat_sweep(sweep: ChatSweep, console: Console) -> tuple[list[ChatResult], list[ReplayStats], dict]:
    """Every (setting, isolation, capacity, policy) of the sweep; also the streams' stats and the
    thresholds used. A stream identical to one already replayed (promotion under ``shared`` or
    ``dedicated`` changes no hash) reuses its results, reported with ``seconds`` 0.0."""
    renderer = ChatRenderer()
    prepared_cache: dict[tuple[float, str], list[PreparedRequest]] = {}

    def prepared_for(timestamp_share: float, canon: str) -> list[PreparedRequest]:
        key = (timestamp_share, canon)
        if key not in prepared_cache:
            prepared_cache.clear()  # one stream in memory at a time (settings are grouped below)
            chat = replace(sweep.chat, timestamp_share=timestamp_share)
            prepared_cache[key] = prepare(chat_workload(sweep.workload, chat), canon, renderer)
        return prepared_cache[key]

    plain = prepared_for(0.0, "off")
    promotion, sizes, config = _calibrate(sweep, plain)
    settings = sorted(sweep.settings, key=lambda s: (s.timestamp_share, s.canon))
    results: list[ChatResult] = []
    stats: list[ReplayStats] = []
    replayed: dict[tuple[str, str, int, bytes], tuple[HitCounts, float]] = {}
    work = len(settings) * len(sweep.isolations) * len(sizes) * len(sweep.policies)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("replaying", total=work)
        for setting, isolation in itertools.product(settings, sweep.isolations):
            progress.update(task, description=f"{setting.name} {isolation}: preparing")
            prepared = prepared_for(setting.timestamp_share, setting.canon)
            run = (
                promote(prepared, isolation, promotion, block_size=sweep.block_size)
                if setting.promotion
                else None
            )
            stream = hash_requests(
                prepared,
                isolation,
                block_size=sweep.block_size,
                promoted_tokens=run.promoted_tokens if run else None,
            )
            stats.append(_stats(setting, isolation, prepared, stream, run))
            digest = _digest(stream)
            for (capacity, blocks), policy in itertools.product(sizes, sweep.policies):
                resolved = DEFAULT_POLICY if policy == "default" else policy
                key = (isolation, resolved, blocks, digest)
                seconds = 0.0
                if key not in replayed:
                    progress.update(task, description=f"{setting.name} {isolation} {policy} {blocks}")
                    started = time.perf_counter()
                    counts = simulate(stream, isolation, resolved, blocks, mode=sweep.mode)
                    replayed[key] = (counts, round(time.perf_counter() - started, 2))
                    seconds = replayed[key][1]
                progress.advance(task)
                results.append(
                    _result(setting, isolation, policy, capacity, blocks, replayed[key][0], sweep, seconds)
                )
    return results, stats, config


def _calibrate(
    sweep: ChatSweep, plain: Sequence[PreparedRequest]
) -> tuple[PromotionSettings, list[tuple[float, int]], dict]:
    """Promotion settings scaled to the trace, cache sizes, and both as a record for the report."""
    duration_s = max(plain[-1].now_s - plain[0].now_s, 1.0)
    requests_per_hour = len(plain) * HOUR_S / duration_s
    promotion = PromotionSettings(
        policy=promotion_policy(sweep, requests_per_hour),
        window_s=sweep.promotion_window_s,
        bucket_s=sweep.promotion_window_s / 60,
        opted_in=opted_in_tenants(sweep.workload.num_tenants, sweep.opt_in_share),
    )
    reference_blocks = _unique(hash_requests(plain, "namespace", block_size=sweep.block_size))
    config = {
        "requests": len(plain),
        "duration_s": round(duration_s, 1),
        "requests_per_hour": round(requests_per_hour),
        "block_size": sweep.block_size,
        "reference_unique_blocks": reference_blocks,
        "min_hits_per_hour": promotion.policy.min_hits_per_hour,
        "min_tenants": promotion.policy.min_tenants,
        "window_s": promotion.window_s,
        "opted_in": sorted(promotion.opted_in),
    }
    return promotion, _sizes(sweep, reference_blocks), config


def _digest(stream: Sequence[ReplayRequest]) -> bytes:
    """Identity of a stream's block ids (ids are numbered in order of appearance, so equal streams of
    hashes give equal ids)."""
    lengths = np.fromiter((len(r.block_ids) for r in stream), dtype=np.int64, count=len(stream))
    ids = np.fromiter(itertools.chain.from_iterable(r.block_ids for r in stream), dtype=np.int64)
    return hashlib.blake2b(lengths.tobytes() + ids.tobytes(), digest_size=16).digest()


def simulate(
    stream: Sequence[ReplayRequest],
    isolation: str,
    policy: str,
    capacity_blocks: int,
    *,
    mode: str = "prefix",
) -> HitCounts:
    """Hit counts of one policy (a registry name or ``belady``) over a hashed stream."""
    counts = []
    for part in hashed_partitions(stream, isolation, capacity_blocks):
        if policy == "belady":
            counts.append(replay_belady(part.requests, part.capacity_blocks))
        else:
            cache = make_policy(policy, part.capacity_blocks)
            counts.append(replay(part.requests, cache, part.capacity_blocks, mode=mode))
    return total(counts)


def _unique(stream: Sequence[ReplayRequest]) -> int:
    return len({block_id for request in stream for block_id in request.block_ids})


def _sizes(sweep: ChatSweep, reference_blocks: int) -> list[tuple[float, int]]:
    if sweep.capacity_blocks is not None:
        return [(round(b / max(reference_blocks, 1), 6), b) for b in sweep.capacity_blocks]
    return [(fraction, max(1, int(fraction * reference_blocks))) for fraction in sweep.capacities or ()]


def _stats(
    setting: Setting,
    isolation: str,
    prepared: Sequence[PreparedRequest],
    stream: Sequence[ReplayRequest],
    run: PromotionRun | None,
) -> ReplayStats:
    num_blocks = sum(len(r.block_ids) for r in stream)
    unique = _unique(stream)
    return ReplayStats(
        setting=setting.name,
        isolation=isolation,
        num_requests=len(prepared),
        timestamped_requests=sum(r.timestamped for r in prepared),
        moved_fragments=sum(r.num_moved for r in prepared),
        prompt_tokens=sum(len(r.token_ids) for r in prepared),
        num_blocks=num_blocks,
        unique_blocks=unique,
        unbounded_hit_ratio=round(1 - unique / num_blocks, 4) if num_blocks else 0.0,
        promotions=len(run.promotions) if run else 0,
        promoted_requests=run.num_promoted_requests if run else 0,
        promoted_tokens=sum(run.promoted_tokens) if run else 0,
        fewest_promotion_senders=min(map(len, run.senders.values())) if run and run.senders else None,
    )


def _result(
    setting: Setting,
    isolation: str,
    policy: str,
    capacity: float,
    blocks: int,
    counts: HitCounts,
    sweep: ChatSweep,
    seconds: float,
) -> ChatResult:
    return ChatResult(
        setting=setting.name,
        canon=setting.canon,
        promotion="on" if setting.promotion else "off",
        timestamp_share=setting.timestamp_share,
        isolation=isolation,
        policy=policy,
        capacity=capacity,
        capacity_blocks=blocks,
        hit_ratio=round(counts.hit_ratio, 4),
        prefix_hit_ratio=round(counts.prefix_hit_ratio, 4),
        reused_tokens=counts.num_prefix_hits * sweep.block_size,
        seconds=seconds,
    )
