"""``python -m bench.hitrate --workload multitenant``: hit ratios with canonicalization and promotion on/off.

The synthetic multi-tenant workload (``bench.workloads``) is written out as chat requests
(``bench.chat_workload``), a share of applications put the current time into their system prompt,
and every setting (``canon=off|report|on`` × ``promotion=off|on`` × ``timestamps=<share>``) is replayed
the gateway's way (``bench.chat_replay``) through the eviction policies at each capacity and isolation
level, with the same cache replay as trace files (``bench.replay``, prefix mode by default).

Capacities given as fractions refer to the workload's own unique blocks: those of the plain replay (no
timestamps, canonicalization off, no promotion, ``namespace`` isolation). Every setting gets the same
absolute size, so settings compare at equal memory. Promotion thresholds scale with the trace (see
``promotion_policy``).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

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
from policies.canonicalize import MODES as CANON_MODES
from policies.eviction import DEFAULT_POLICY, make_policy
from policies.promotion import HOUR_S, PromotionPolicy

WORKLOADS = ("multitenant",)
DEFAULT_SETTINGS = ("canon=off,on", "promotion=off,on")
DEFAULT_POLICIES = ("default", "lru")
DEFAULT_CAPACITIES = (0.05, 0.1, 0.2)
DEFAULT_ISOLATIONS = ("shared", "namespace")
DEFAULT_BLOCK_TOKENS = 32
DEFAULT_TIMESTAMP_SHARE = 0.3
DEFAULT_PROMOTION_SHARE = 0.01  # of the trace's requests per hour: the production 1000/h at 100k/h
DEFAULT_PROMOTION_WINDOW_S = 600.0  # the production hour, scaled so that it slides inside the trace
QUICK_REQUESTS = 1000
DEFAULT_PLOT = Path(__file__).parent / "out" / "canon_promotion.png"


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


def print_tables(
    results: Sequence[ChatResult], stats: Sequence[ReplayStats], config: dict, out: Console
) -> None:
    """One table per setting (flat / prefix-usable hit ratio and tokens reused per capacity), then a
    summary of the prefix-usable hit ratio of the default policy."""
    out.print(
        f"workload: {config['requests']} requests over {config['duration_s']} s "
        f"({config['requests_per_hour']} per hour), block size {config['block_size']} tokens; "
        f"capacities refer to {config['reference_unique_blocks']} unique blocks (plain replay, namespace)"
    )
    out.print(
        f"promotion: min {config['min_hits_per_hour']} hits/hour and {config['min_tenants']} tenants "
        f"in a {config['window_s']:g} s window; opted in: {', '.join(config['opted_in']) or 'none'}"
    )
    capacities = sorted({r.capacity for r in results})
    policies = list(dict.fromkeys(r.policy for r in results))
    by_key = {(r.setting, r.isolation, r.policy, r.capacity): r for r in results}
    for setting in dict.fromkeys(r.setting for r in results):
        rows = [s for s in stats if s.setting == setting]
        table = Table(
            title=f"{setting}: hit ratio flat / prefix-usable · tokens reused",
            caption=f"{rows[0].num_requests} requests, {rows[0].timestamped_requests} with the time in the "
            f"system prompt, {rows[0].moved_fragments} fragments moved, "
            f"{rows[0].prompt_tokens / 1e6:.2f}M prompt tokens",
        )
        for column in ("isolation", "policy"):
            table.add_column(column)
        for capacity in capacities:
            table.add_column(f"{capacity:g}", justify="right")
        for column in ("unbounded", "promotions", "promoted requests", "fewest tenants"):
            table.add_column(column, justify="right")
        for s, policy in itertools.product(rows, policies):
            cells = [by_key.get((setting, s.isolation, policy, c)) for c in capacities]
            table.add_row(
                s.isolation,
                policy,
                *(
                    f"{r.hit_ratio:.4f} / {r.prefix_hit_ratio:.4f} · {r.reused_tokens / 1e6:.2f}M"
                    if r
                    else "-"
                    for r in cells
                ),
                f"{s.unbounded_hit_ratio:.4f}",
                str(s.promotions),
                str(s.promoted_requests),
                "-" if s.fewest_promotion_senders is None else str(s.fewest_promotion_senders),
            )
        out.print(table)
    summary = Table(title=f"Prefix-usable hit ratio, {DEFAULT_POLICY} policy (default)")
    summary.add_column("setting")
    columns = [(i, c) for i in dict.fromkeys(s.isolation for s in stats) for c in capacities]
    for isolation, capacity in columns:
        summary.add_column(f"{isolation} {capacity:g}", justify="right")
    for setting in dict.fromkeys(r.setting for r in results):
        row = [by_key.get((setting, i, "default", c)) for i, c in columns]
        summary.add_row(setting, *(f"{r.prefix_hit_ratio:.4f}" if r else "-" for r in row))
    if "default" in policies:
        out.print(summary)


def save_plot(results: Sequence[ChatResult], path: Path) -> None:
    """Prefix-usable hit ratio of the default policy (else the first one) against capacity, one panel
    per isolation level: one colour per (timestamps, canon), solid with promotion, dashed without."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(r.policy for r in results))
    policy = "default" if "default" in policies else policies[0]
    shown = [r for r in results if r.policy == policy]
    isolations = list(dict.fromkeys(r.isolation for r in shown))
    settings = list(dict.fromkeys((r.setting, r.timestamp_share, r.canon, r.promotion) for r in shown))
    colour_of = {key: index for index, key in enumerate(dict.fromkeys((s[1], s[2]) for s in settings))}
    colours = plt.get_cmap("tab10")
    figure, axes = plt.subplots(1, len(isolations), figsize=(5 * len(isolations), 4.2), squeeze=False)
    for ax, isolation in zip(axes[0], isolations, strict=True):
        for setting, timestamp_share, canon, promotion in settings:
            points = sorted(
                (r.capacity, r.prefix_hit_ratio)
                for r in shown
                if (r.isolation, r.setting) == (isolation, setting)
            )
            if points:
                ax.plot(
                    *zip(*points, strict=True),
                    "-" if promotion == "on" else "--",
                    marker="o" if promotion == "on" else "x",
                    color=colours(colour_of[(timestamp_share, canon)] % 10),
                    label=setting,
                )
        ax.set_title(f"{isolation} ({policy} policy)", fontsize=10)
        ax.set_xlabel("capacity (fraction of the plain replay's unique blocks)")
        ax.set_ylabel("prefix-usable hit ratio")
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    rows = (len(labels) + 1) // 2
    figure.legend(handles, labels, loc="lower center", ncol=2, fontsize=8)
    figure.tight_layout(rect=(0, 0.04 + 0.045 * rows, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--workload`` options of ``python -m bench.hitrate``."""
    group = parser.add_argument_group("synthetic chat workload (--workload)")
    group.add_argument("--workload", choices=WORKLOADS, help="replay the synthetic workload as chat requests")
    group.add_argument(
        "--settings",
        nargs="+",
        metavar="KEY=VALUES",
        help="canon=off,report,on promotion=off,on timestamps=0,0.3 (the product is replayed; "
        f"default {' '.join(DEFAULT_SETTINGS)})",
    )
    group.add_argument(
        "--timestamp-share",
        type=float,
        default=DEFAULT_TIMESTAMP_SHARE,
        help="share of applications (tenant, system prompt) that put the time into the system prompt, "
        "when --settings has no timestamps=",
    )
    group.add_argument(
        "--tool-shuffle-share", type=float, default=0.0, help="share of tenants that shuffle tools"
    )
    group.add_argument("--num-requests", type=int, help=f"default {WorkloadSpec().num_requests}")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS, help="KV block size")
    group.add_argument(
        "--opt-in-share", type=float, default=1.0, help="share of tenants sharing hot prefixes"
    )
    group.add_argument(
        "--promotion-share",
        type=float,
        default=DEFAULT_PROMOTION_SHARE,
        help="min hits per hour as a share of the trace's requests per hour",
    )
    group.add_argument("--promotion-min-hits", type=int, help="min hits per hour (overrides the share)")
    group.add_argument("--promotion-min-tenants", type=int, default=3)
    group.add_argument("--promotion-window-s", type=float, default=DEFAULT_PROMOTION_WINDOW_S)


def parse_settings(items: Sequence[str], timestamp_share: float) -> tuple[Setting, ...]:
    """``["canon=off,on", "promotion=off,on"]`` → the product; raises ValueError on bad input."""
    values: dict[str, tuple[str, ...]] = {"canon": ("off",), "promotion": ("off",)}
    values["timestamps"] = (str(timestamp_share),)
    for item in items:
        key, _, text = item.partition("=")
        if key not in values or not text:
            raise ValueError(f"setting {item!r}: expected canon=…, promotion=… or timestamps=…")
        values[key] = tuple(v.strip() for v in text.split(",") if v.strip())
    for canon in values["canon"]:
        if canon not in CANON_MODES:
            raise ValueError(f"canon={canon}: known modes {', '.join(CANON_MODES)}")
    for promotion in values["promotion"]:
        if promotion not in ("on", "off"):
            raise ValueError(f"promotion={promotion}: on or off")
    try:
        shares = [float(v) for v in values["timestamps"]]
    except ValueError:
        raise ValueError(f"timestamps={','.join(values['timestamps'])}: shares between 0 and 1") from None
    if not all(0.0 <= s <= 1.0 for s in shares):
        raise ValueError("timestamp shares must be between 0 and 1")
    return tuple(
        Setting(canon=canon, promotion=promotion == "on", timestamp_share=share)
        for share, canon, promotion in itertools.product(shares, values["canon"], values["promotion"])
    )


def sweep_from_args(
    args: argparse.Namespace, policies: tuple[str, ...] | None, error: Callable[[str], None]
) -> ChatSweep:
    """The sweep the command line asks for (``error`` reports bad input and exits)."""
    try:
        settings = parse_settings(args.settings or DEFAULT_SETTINGS, args.timestamp_share)
    except ValueError as exc:
        error(str(exc))
    num_requests = args.num_requests or (QUICK_REQUESTS if args.quick else WorkloadSpec().num_requests)
    workload = WorkloadSpec(num_requests=num_requests, seed=args.seed)
    return ChatSweep(
        workload=workload,
        chat=ChatSpec(tool_shuffle_share=args.tool_shuffle_share),
        settings=settings,
        policies=policies or DEFAULT_POLICIES,
        capacities=None if args.capacity_blocks else (_floats(args.capacity) or DEFAULT_CAPACITIES),
        capacity_blocks=tuple(int(v) for v in args.capacity_blocks.split(","))
        if args.capacity_blocks
        else None,
        isolations=tuple(args.isolation.split(",")) if args.isolation else DEFAULT_ISOLATIONS,
        mode=args.mode or "prefix",
        block_size=args.block_tokens,
        opt_in_share=args.opt_in_share,
        promotion_share=args.promotion_share,
        promotion_min_hits=args.promotion_min_hits,
        promotion_min_tenants=args.promotion_min_tenants,
        promotion_window_s=args.promotion_window_s,
    )


def _floats(text: str | None) -> tuple[float, ...]:
    return tuple(float(v) for v in (text or "").split(",") if v.strip())


def run(sweep: ChatSweep, plot: Path | None, console: Console, out: Console) -> None:
    """Simulate, print the tables, save the plot, print the JSON line."""
    started = time.perf_counter()
    results, stats, config = run_chat_sweep(sweep, console)
    print_tables(results, stats, config, out)
    out.print(f"default policy: {DEFAULT_POLICY}; total {time.perf_counter() - started:.1f} s")
    if plot is not None:
        save_plot(results, plot)
        out.print(f"plot: {plot}")
    record = {
        "config": config,
        "replays": [asdict(s) for s in stats],
        "results": [asdict(r) for r in results],
    }
    print(json.dumps(record))
