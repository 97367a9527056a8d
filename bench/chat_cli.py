"""Command line and report of ``python -m bench.hitrate --workload multitenant`` (``bench.chat_sweep``).

One table per setting (flat / prefix-usable hit ratio and tokens reused per capacity, with the stream's
infinite-cache ratio and what promotion did), a summary of the default policy, a plot, and one JSON
line: ``{"config", "replays", "results": [{"setting", "isolation", "policy", "capacity", "hit_ratio",
"prefix_hit_ratio", "reused_tokens", …}]}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.chat_sweep import (
    ChatResult,
    ChatSweep,
    ReplayStats,
    Setting,
    run_chat_sweep,
)
from bench.chat_workload import ChatSpec
from bench.workloads import WorkloadSpec
from policies.canonicalize import MODES as CANON_MODES
from policies.eviction import DEFAULT_POLICY

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
        "--tool-shuffle-share",
        type=float,
        default=0.0,
        help="share of tenants whose client shuffles tool order and keys",
    )
    group.add_argument("--num-requests", type=int, help=f"default {WorkloadSpec().num_requests}")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--block-tokens",
        type=int,
        default=DEFAULT_BLOCK_TOKENS,
        help=f"KV block size in tokens (default {DEFAULT_BLOCK_TOKENS}; the worker's is 16)",
    )
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
