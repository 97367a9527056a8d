"""What an eviction policy costs on the worker's hot path, in the real ``BlockManager``.

A stream of prompts of ``--blocks`` blocks each, drawn from ``--docs`` distinct documents, goes through
a pool of ``--pool-blocks`` blocks the way the scheduler drives it: match the cached prefix, acquire it,
allocate the rest (evicting), publish the new blocks, release. The time per prompt is split into full
hits and misses (allocate, evict, publish). Policies run interleaved, ``--rounds`` times each (2), so the
ratios are taken under the same machine load. ``--cpu-time`` times with this process's CPU clock
instead of the wall clock: on a shared box other processes then add no time of their own, only cache
effects.

    python -m bench.eviction_cost [--quick] [--policies lru,prefix,adaptive] [--rounds 2] [--cpu-time]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from policies.hashing import BlockHash, chain_hash, root_hash, tokens_to_bytes
from worker.block_manager import BlockManager


def chain(doc: int, num_blocks: int, block_tokens: int) -> tuple[list[BlockHash], list[tuple[int, ...]]]:
    tokens = [
        tuple((doc * 7919 + k * block_tokens + i) % 250 for i in range(block_tokens))
        for k in range(num_blocks)
    ]
    hashes: list[BlockHash] = []
    parent = root_hash(b"bench", b"ns")
    for block in tokens:
        parent = chain_hash(parent, tokens_to_bytes(block))
        hashes.append(parent)
    return hashes, tokens


def run(
    policy: str,
    *,
    num_prompts: int,
    num_docs: int,
    num_blocks: int,
    pool_blocks: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Mean milliseconds per prompt for full hits and for misses (``clock``'s seconds), and the hit count."""
    bm = BlockManager(pool_blocks, 16, eviction_policy=policy, clock=time.monotonic)
    rng = random.Random(0)
    chains = [chain(doc, num_blocks, 16) for doc in range(num_docs)]
    hit_s: list[float] = []
    miss_s: list[float] = []
    for _ in range(num_prompts):
        hashes, tokens = chains[rng.randrange(num_docs)]
        started = clock()
        cached = bm.match_prefix(hashes, tokens)
        bm.acquire(cached)
        new = bm.allocate_many(num_blocks - len(cached), "ns") if len(cached) < num_blocks else []
        for j, block_id in enumerate(new):
            k = len(cached) + j
            parent = hashes[k - 1] if k else None
            bm.cache(block_id, hashes[k], tokens[k], parent, namespace_id="ns", position=k)
        bm.release(cached + new)
        (hit_s if len(cached) == num_blocks else miss_s).append(clock() - started)
    return {
        "hit_ms": 1000 * statistics.fmean(hit_s) if hit_s else 0.0,
        "miss_ms": 1000 * statistics.fmean(miss_s) if miss_s else 0.0,
        "hits": len(hit_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer prompts (a few seconds)")
    parser.add_argument("--policies", default="lru,prefix,adaptive")
    parser.add_argument("--blocks", type=int, default=256, help="blocks per prompt (256 = 4k tokens)")
    parser.add_argument("--docs", type=int, default=12)
    parser.add_argument("--pool-blocks", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved runs of each policy")
    parser.add_argument("--cpu-time", action="store_true", help="time with this process's CPU clock")
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    num_prompts = 30 if args.quick else 120
    policies = args.policies.split(",")
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in policies}
    for _ in range(args.rounds):
        for policy in policies:
            runs[policy].append(
                run(
                    policy,
                    num_prompts=num_prompts,
                    num_docs=args.docs,
                    num_blocks=args.blocks,
                    pool_blocks=args.pool_blocks,
                    clock=clock,
                )
            )
    result = {
        p: {k: round(statistics.fmean(r[k] for r in rs), 3) for k in ("hit_ms", "miss_ms")}
        for p, rs in runs.items()
    }
    base = result[policies[0]]
    table = Table(
        title=f"eviction policy cost per {args.blocks}-block prompt (pool {args.pool_blocks} blocks)"
    )
    for column in ("policy", "full hit ms", f"× {policies[0]}", "miss ms", f"× {policies[0]}"):
        table.add_column(column, justify="right")
    for policy, row in result.items():
        table.add_row(
            policy,
            f"{row['hit_ms']:.2f}",
            f"{row['hit_ms'] / base['hit_ms']:.2f}" if base["hit_ms"] else "-",
            f"{row['miss_ms']:.2f}",
            f"{row['miss_ms'] / base['miss_ms']:.2f}" if base["miss_ms"] else "-",
        )
    Console().print(table)
    print(
        json.dumps(
            {
                "bench": "eviction_cost",
                "blocks_per_prompt": args.blocks,
                "clock": "cpu" if args.cpu_time else "wall",
                "rounds": args.rounds,
                "policies": result,
            }
        )
    )


if __name__ == "__main__":
    main()
