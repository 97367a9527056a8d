"""Prefix-cache hit ratio of the eviction policies on request traces.

    python -m bench.hitrate --trace ../shared/traces/mooncake_synthetic_trace.jsonl

Replays each trace through the same policy objects the worker's pool uses (``policies.eviction``), for
every policy, capacity, isolation level and replay mode asked for, and reports the flat block hit ratio
and the prefix-usable hit ratio (a block counts only if every earlier block of its request hit).
``belady`` is the offline upper bound (``bench/belady.py``); ``default`` is the worker's default policy.
Prints a table, saves a plot of hit ratio against capacity, and ends with one JSON line:
``{"results": [{"trace", "policy", "capacity", "hit_ratio", "prefix_hit_ratio", …}]}``.

    python -m bench.hitrate --workload multitenant --settings canon=off,on promotion=off,on

replays the synthetic multi-tenant workload as chat requests instead, with canonicalization and
hot-prefix promotion on and off and timestamps injected into a share of system prompts
(``bench/chat_sweep.py``, ``bench/chat_cli.py``); its JSON line is ``{"config", "replays",
"results": [{"setting", "isolation", "policy", "capacity", "hit_ratio", "prefix_hit_ratio",
"reused_tokens", …}]}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench import chat_cli, chat_sweep
from bench.belady import replay_belady
from bench.isolation import ISOLATION_LEVELS, partitions
from bench.replay import MODES, HitCounts, replay, total
from bench.trace import TraceRequest, load_trace, num_unique_blocks
from policies.eviction import DEFAULT_POLICY, POLICIES, make_policy

DEFAULT_CAPACITIES = (0.01, 0.05, 0.1, 0.2)
DEFAULT_POLICIES = ("lru", "s3fifo", "arc", "prefix", "default", "belady")
QUICK_REQUESTS = 1000
DEFAULT_PLOT = Path(__file__).parent / "out" / "hitrate.png"


@dataclass(frozen=True, kw_only=True, slots=True)
class Result:
    """Hit ratios of one policy at one capacity on one trace."""

    trace: str  # file name
    policy: str  # as asked (``default`` stays ``default``)
    capacity: float  # fraction of the trace's unique blocks
    capacity_blocks: int
    isolation: str
    mode: str
    hit_ratio: float
    prefix_hit_ratio: float
    seconds: float  # simulation time (0.0 when reused from an identical run, e.g. ``default``)


@dataclass(frozen=True, kw_only=True, slots=True)
class Sweep:
    """What to simulate."""

    traces: tuple[Path, ...]
    policies: tuple[str, ...]
    capacities: tuple[float, ...] | None  # fractions; None when sizes are given in blocks
    capacity_blocks: tuple[int, ...] | None
    isolations: tuple[str, ...]
    modes: tuple[str, ...]
    max_requests: int | None  # only the first requests of each trace (``--quick``)


def simulate_one(
    requests: Sequence[TraceRequest],
    policy: str,
    capacity_blocks: int,
    *,
    isolation: str = "shared",
    mode: str = "prefix",
    on_request: Callable[[], None] | None = None,
) -> HitCounts:
    """Hit counts of one policy (a registry name, ``default`` or ``belady``) over the whole trace."""
    counts = []
    for part in partitions(requests, isolation, capacity_blocks):
        if policy == "belady":
            counts.append(replay_belady(part.requests, part.capacity_blocks, on_request=on_request))
        else:
            cache = make_policy(policy, part.capacity_blocks)
            counts.append(
                replay(part.requests, cache, part.capacity_blocks, mode=mode, on_request=on_request)
            )
    return total(counts)


def run_sweep(sweep: Sweep, console: Console) -> list[Result]:
    """Every (trace, isolation, mode, capacity, policy) combination of the sweep, with a progress bar."""
    cases = []  # (trace path, requests, isolation, mode, capacity fraction, capacity in blocks)
    for path in sweep.traces:
        requests = load_trace(path)[: sweep.max_requests]
        sizes = _sizes(sweep, num_unique_blocks(requests))
        for isolation, mode, (capacity, blocks) in itertools.product(sweep.isolations, sweep.modes, sizes):
            cases.append((path, requests, isolation, mode, capacity, blocks))
    results: list[Result] = []
    with Progress(console=console, transient=True) as progress:
        work = sum(len(case[1]) for case in cases) * len(sweep.policies)
        task = progress.add_task("replaying", total=work)
        for path, requests, isolation, mode, capacity, blocks in cases:
            done: dict[str, Result] = {}  # resolved policy name -> its result (``default`` reuses one)
            for policy in sweep.policies:
                resolved = DEFAULT_POLICY if policy == "default" else policy
                if resolved in done:
                    progress.advance(task, len(requests))
                    results.append(_renamed(done[resolved], policy))
                    continue
                progress.update(task, description=f"{path.name} {isolation} {mode} {policy} {blocks}")
                started = time.perf_counter()
                counts = simulate_one(
                    requests,
                    resolved,
                    blocks,
                    isolation=isolation,
                    mode=mode,
                    on_request=lambda: progress.advance(task),
                )
                done[resolved] = Result(
                    trace=path.name,
                    policy=policy,
                    capacity=capacity,
                    capacity_blocks=blocks,
                    isolation=isolation,
                    mode=mode,
                    hit_ratio=round(counts.hit_ratio, 4),
                    prefix_hit_ratio=round(counts.prefix_hit_ratio, 4),
                    seconds=round(time.perf_counter() - started, 2),
                )
                results.append(done[resolved])
    return results


def _sizes(sweep: Sweep, num_unique: int) -> list[tuple[float, int]]:
    if sweep.capacity_blocks is not None:
        return [(round(blocks / max(num_unique, 1), 6), blocks) for blocks in sweep.capacity_blocks]
    return [(fraction, max(1, int(fraction * num_unique))) for fraction in sweep.capacities or ()]


def _renamed(result: Result, policy: str) -> Result:
    return Result(**{**asdict(result), "policy": policy, "seconds": 0.0})


def print_table(results: Sequence[Result], console: Console) -> None:
    """One row per (trace, isolation, mode, policy), one column pair (flat / prefix) per capacity."""
    capacities = sorted({r.capacity for r in results})
    table = Table(title="Block hit ratio: flat / prefix-usable")
    for column in ("trace", "isolation", "mode", "policy"):
        table.add_column(column)
    for capacity in capacities:
        table.add_column(f"{capacity:g}", justify="right")
    table.add_column("time s", justify="right")
    rows: dict[tuple[str, str, str, str], dict[float, Result]] = {}
    for r in results:
        rows.setdefault((r.trace, r.isolation, r.mode, r.policy), {})[r.capacity] = r
    for key, by_capacity in rows.items():
        cells = [
            f"{by_capacity[c].hit_ratio:.4f} / {by_capacity[c].prefix_hit_ratio:.4f}"
            if c in by_capacity
            else "-"
            for c in capacities
        ]
        seconds = sum(r.seconds for r in by_capacity.values())
        table.add_row(*key, *cells, f"{seconds:.1f}")
    console.print(table)


def save_plot(results: Sequence[Result], path: Path) -> None:
    """Prefix-usable hit ratio against capacity, one panel per (trace, isolation, mode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r.trace, r.isolation, r.mode) for r in results})
    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for policy in dict.fromkeys(r.policy for r in results):
            if policy == "default" and any(r.policy == DEFAULT_POLICY for r in results):
                continue  # same curve as the policy it names
            points = sorted(
                (r.capacity, r.prefix_hit_ratio)
                for r in results
                if (r.trace, r.isolation, r.mode) == panel and r.policy == policy
            )
            if points:
                style = "--" if policy == "belady" else "-"
                ax.plot(*zip(*points, strict=True), style, marker="o", label=policy)
        ax.set_title(" / ".join(panel), fontsize=9)
        ax.set_xlabel("capacity (fraction of unique blocks)")
        ax.set_ylabel("prefix-usable hit ratio")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)


def _csv(text: str, cast: Callable[[str], object]) -> tuple:
    return tuple(cast(item.strip()) for item in text.split(",") if item.strip())


def parse_args(argv: Sequence[str] | None = None) -> tuple[Sweep | chat_sweep.ChatSweep, Path | None]:
    parser = argparse.ArgumentParser(prog="python -m bench.hitrate", description=__doc__.split("\n")[0])
    parser.add_argument("--trace", action="append", type=Path, help="JSONL trace (repeatable)")
    parser.add_argument("--capacity", help="fractions of unique blocks, e.g. 0.01,0.05,0.1,0.2")
    parser.add_argument("--capacity-blocks", help="absolute sizes in blocks, e.g. 500,2000")
    parser.add_argument(
        "--policy",
        help=f"comma-separated policies (default {','.join(DEFAULT_POLICIES)}; "
        f"with --workload {','.join(chat_cli.DEFAULT_POLICIES)})",
    )
    parser.add_argument(
        "--isolation",
        help=f"comma-separated: {','.join(ISOLATION_LEVELS)} (default shared; "
        f"with --workload {','.join(chat_cli.DEFAULT_ISOLATIONS)})",
    )
    parser.add_argument("--mode", help=f"comma-separated replay modes: {','.join(MODES)} (default prefix)")
    parser.add_argument("--plot", type=Path, help=f"where to save the plot (default {DEFAULT_PLOT})")
    parser.add_argument("--no-plot", action="store_true", help="do not save a plot")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"first {QUICK_REQUESTS} requests of each trace "
        f"(--workload: {chat_cli.QUICK_REQUESTS} requests)",
    )
    chat_cli.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.capacity and args.capacity_blocks:
        parser.error("give --capacity or --capacity-blocks, not both")
    if bool(args.trace) == bool(args.workload):
        parser.error("give --trace (one or more) or --workload, not both")
    policies = _csv(args.policy or ",".join(DEFAULT_POLICIES), str)
    known = {*POLICIES, "default", "belady"}
    for name in policies:
        if name not in known:
            parser.error(f"unknown policy {name!r}; known: {', '.join(sorted(known))}")
    for option, values, allowed in (
        ("--isolation", _csv(args.isolation or "", str), ISOLATION_LEVELS),
        ("--mode", _csv(args.mode or "", str), MODES),
    ):
        for value in values:
            if value not in allowed:
                parser.error(f"{option}: unknown {value!r}; known: {', '.join(allowed)}")
    if args.workload:
        if args.mode and "," in args.mode:
            parser.error("--workload replays in one --mode")
        sweep = chat_cli.sweep_from_args(args, policies if args.policy else None, parser.error)
        return sweep, None if args.no_plot else (args.plot or chat_cli.DEFAULT_PLOT)
    sweep = Sweep(
        traces=tuple(args.trace),
        policies=policies,
        capacities=None if args.capacity_blocks else (_csv(args.capacity or "", float) or DEFAULT_CAPACITIES),
        capacity_blocks=_csv(args.capacity_blocks, int) if args.capacity_blocks else None,
        isolations=_csv(args.isolation or "shared", str),
        modes=_csv(args.mode or "prefix", str),
        max_requests=QUICK_REQUESTS if args.quick else None,
    )
    return sweep, None if args.no_plot else (args.plot or DEFAULT_PLOT)


def main(argv: Sequence[str] | None = None) -> None:
    sweep, plot = parse_args(argv)
    console = Console(stderr=True)  # progress and notes; stdout carries the table and the JSON line
    out = Console()
    if not out.is_terminal:
        out = Console(width=200)
    if isinstance(sweep, chat_sweep.ChatSweep):
        chat_cli.run(sweep, plot, console, out)
        return
    started = time.perf_counter()
    results = run_sweep(sweep, console)
    print_table(results, out)
    out.print(f"default policy: {DEFAULT_POLICY}; total simulation {time.perf_counter() - started:.1f} s")
    if plot is not None:
        save_plot(results, plot)
        out.print(f"plot: {plot}")
    print(json.dumps({"results": [asdict(r) for r in results]}))


if __name__ == "__main__":
    main()
