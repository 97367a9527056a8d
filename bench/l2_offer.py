"""Offering a prefetched chain to L2: one ``HostTier.put`` per block (before) against ``put_many``.

    python -m bench.l2_offer [--blocks 256 2048]

The engine offers every chain it restores from L3 or Redis to L2 (``TieredStore.finish_prefetch``) on
its own thread, before the request is admitted. Per block, linking it to its cached parent walked the
chain up and down (quadratic in its length); ``put_many`` keeps the run referenced until it is all in,
so each link is O(1). Best of 3, side by side in one process. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from rich.console import Console
from rich.table import Table

from bench.tiers import _chain
from worker.model.loader import load_model
from worker.tiers.host import HostTier


def offer_seconds(shape: tuple[int, ...], num_blocks: int, repeats: int = 3) -> dict[str, float]:
    chain = _chain(num_blocks, shape, torch.float32)
    data = torch.stack([b.data for b in chain])
    records = [b.record for b in chain]
    best: dict[str, float] = {}
    for _ in range(repeats):
        for how in ("put_per_block", "put_many"):
            host = HostTier(
                capacity_blocks=num_blocks + 16, block_shape=shape, dtype=torch.float32, pin_memory=False
            )
            started = time.perf_counter()
            if how == "put_many":
                host.put_many(records, ["bench"] * num_blocks, list(range(num_blocks)), data)
            else:
                for k, record in enumerate(records):
                    host.put(record, "bench", k, data[k])
            best[how] = min(best.get(how, float("inf")), time.perf_counter() - started)
            assert (
                len(host.match([r.block_hash for r in records], [r.token_ids for r in records])) == num_blocks
            )
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--model", default="random-bench")
    args = parser.parse_args()
    cfg = load_model(args.model, dtype=torch.float32, device=torch.device("cpu")).config
    shape = (cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim)
    table = Table(title=f"offering a chain to L2 ({args.model}, best of 3)")
    for column in ("blocks", "put per block", "put_many", "ratio"):
        table.add_column(column, justify="right")
    results = {}
    for num_blocks in args.blocks:
        best = offer_seconds(shape, num_blocks)
        results[num_blocks] = {k: round(v * 1000, 1) for k, v in best.items()}
        ratio = best["put_per_block"] / best["put_many"]
        results[num_blocks]["ratio"] = round(ratio, 2)
        table.add_row(
            str(num_blocks),
            f"{best['put_per_block'] * 1000:.1f} ms",
            f"{best['put_many'] * 1000:.1f} ms",
            f"{ratio:.1f}x",
        )
    Console().print(table)
    print(json.dumps({"offer_ms": results}))


if __name__ == "__main__":
    main()
