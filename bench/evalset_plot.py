"""Plot the eviction guarantee margins from ``python -m bench.evalset`` output.

    python -m bench.evalset > full.log
    python -m bench.evalset_plot full.log [more.log ...] --out docs/img/eviction_guarantee.png

Reads the JSON line(s) the evaluation set prints and draws one cell per (trace, capacity): the
default's prefix-usable hit ratio minus max(LRU, ARC). The guarantee is every cell ≥ −0.005. The
second round's held-out traces are marked "held out", the first round's (now tuned on) apart. Ends
with one JSON line: the worst margin and the cells below the bound.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.evalset import evaluation_set

NOISE = 0.005


def margins(lines: list[str]) -> tuple[dict[tuple[str, float], float], dict[str, bool]]:
    """(trace, capacity) -> default − max(lru, arc), and trace -> held out, from evalset JSON lines."""
    ratios: dict[tuple[str, float, str], float] = {}
    held_out: dict[str, bool] = {}
    for line in lines:
        if not line.startswith('{"results"'):
            continue
        for row in json.loads(line)["results"]:
            ratios[(row["trace"], row["capacity"], row["policy"])] = row["prefix_hit_ratio"]
            held_out[row["trace"]] = row["held_out"]
    cells = {}
    for trace, capacity, policy in ratios:
        if policy == "default":
            best = max(ratios[(trace, capacity, "lru")], ratios[(trace, capacity, "arc")])
            cells[(trace, capacity)] = ratios[(trace, capacity, "default")] - best
    return cells, held_out


def save_plot(cells: dict[tuple[str, float], float], held_out: dict[str, bool], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(trace for trace, _ in cells))
    capacities = sorted({capacity for _, capacity in cells})
    grid = [[cells.get((t, c), float("nan")) for c in capacities] for t in traces]
    figure, ax = plt.subplots(figsize=(6.5, 0.45 * len(traces) + 1.6))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=-0.03, vmax=0.03, aspect="auto")
    for row, trace in enumerate(traces):
        for column, capacity in enumerate(capacities):
            value = cells.get((trace, capacity))
            if value is not None:
                weight = "bold" if value < -NOISE else "normal"
                ax.text(column, row, f"{value:+.4f}", ha="center", va="center", fontsize=8, weight=weight)
    ax.set_xticks(range(len(capacities)), [f"{c:.0%}" for c in capacities])
    fresh = {t.name for t in evaluation_set() if t.fresh}
    labels = [
        f"{t} (held out)" if t in fresh else f"{t} (1st-round held out)" if held_out.get(t) else t
        for t in traces
    ]
    ax.set_yticks(range(len(traces)), labels)
    ax.set_xlabel("capacity (fraction of the trace's unique blocks)")
    ax.set_title("default − max(LRU, ARC), prefix-usable hit ratio (bound: ≥ −0.005)", fontsize=9)
    figure.colorbar(image, ax=ax, fraction=0.04)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.evalset_plot", description=__doc__.split("\n")[0])
    parser.add_argument("logs", nargs="+", type=Path, help="files holding bench.evalset output")
    parser.add_argument("--out", type=Path, default=Path("docs/img/eviction_guarantee.png"))
    args = parser.parse_args(argv)
    lines = [line for log in args.logs for line in log.read_text(encoding="utf-8").splitlines()]
    cells, held_out = margins(lines)
    save_plot(cells, held_out, args.out)
    below = sorted((t, c, round(m, 4)) for (t, c), m in cells.items() if m < -NOISE)
    print(f"plot: {args.out}")
    worst = round(min(cells.values()), 4)
    print(json.dumps({"worst_margin": worst, "cells": len(cells), "below_bound": below}))


if __name__ == "__main__":
    main()
