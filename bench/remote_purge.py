"""A tenant's purge from Redis over a slow link: per key (before) against one erase call per chunk.

    python -m bench.remote_purge --redis-url redis://127.0.0.1:6379/5 [--blocks 32 128] [--delay-ms 150]

The purge fence stays up (work of the tenant is not cached) until Redis is erased. The erase used to
delete each key with one pipeline and correct its byte count with another call: two round trips per key,
10-13.7 s for a few dozen blocks with Redis 0.15 s away. ``RemoteTier.purge`` now sends one Lua call per
chunk of 256 keys after each SCAN page. Both run side by side (alternating, fresh blocks each time)
through a proxy that holds every reply ``--delay-ms``; the round trips are counted by the proxy.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from rich.console import Console
from rich.table import Table

from tests.worker.test_tier_faults import SlowLink
from worker.tiers.entry import BlockRecord
from worker.tiers.host import DemotedBlock
from worker.tiers.remote import RemoteTier, _glob_escape, _is_block_key

SHAPE = (2, 2, 16, 2, 16)
FINGERPRINT = b"bench-remote-purge" * 2


def _purge_per_key(tier: RemoteTier, namespace_id: str) -> int:
    """The erase as it was before (two round trips per key), kept here as the reference."""
    erased = 0
    books = [(tier._lru, tier._sizes, tier._total), tuple(tier._partition(namespace_id))]
    head = f"{tier.prefix}:{namespace_id}:"
    for key in tier.client.scan_iter(match=_glob_escape(head) + "*", count=500):
        if not _is_block_key(key, head):
            continue
        pipe = tier.client.pipeline()
        pipe.delete(key)
        for lru, sizes, _ in books:
            pipe.hget(sizes, key)
            pipe.zrem(lru, key)
            pipe.hdel(sizes, key)
        deleted, *rest = pipe.execute()
        for (_, _, total), size in zip(books, rest[0::3], strict=True):
            if size:
                tier.client.decrby(total, int(size))
        erased += int(deleted)
    return erased


def _tier(url: str) -> RemoteTier:
    return RemoteTier(
        url,
        fingerprint=FINGERPRINT,
        codec="none",
        block_shape=SHAPE,
        dtype=torch.float32,
        budget_bytes=1 << 30,
        ttl_s=600,
        timeout_s=30.0,
    )


def _fill(tier: RemoteTier, namespace_id: str, num_blocks: int, seed: int) -> None:
    blocks = [
        DemotedBlock(
            record=BlockRecord(
                block_hash=seed.to_bytes(4, "little") + k.to_bytes(4, "little") * 7,
                parent_hash=None,
                token_ids=tuple(range(16)),
            ),
            namespace_id=namespace_id,
            position=0,
            data=torch.zeros(SHAPE),
        )
        for k in range(num_blocks)
    ]
    for start in range(0, num_blocks, 64):
        tier.put(blocks[start : start + 64])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--blocks", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--delay-ms", type=float, default=150.0)
    parser.add_argument("--skip-per-key-above", type=int, default=64, help="blocks; the old erase is slow")
    args = parser.parse_args()
    host_port, db = args.redis_url.removeprefix("redis://").split("/")
    port = int(host_port.split(":")[1])
    direct = _tier(args.redis_url)
    link = SlowLink(port, delay_s=args.delay_ms / 1000)
    slow = _tier(f"redis://127.0.0.1:{link.port}/{db}")
    table = Table(title=f"purge of one tenant's Redis blocks, replies held {args.delay_ms:.0f} ms")
    for column in ("blocks", "erase", "seconds", "round trips"):
        table.add_column(column, justify="right")
    results: dict[str, dict[str, dict[str, float]]] = {}
    seed = 0
    try:
        for num_blocks in args.blocks:
            ways = {"per_key": _purge_per_key, "batched": RemoteTier.purge}
            if num_blocks > args.skip_per_key_above:
                del ways["per_key"]
            for name, purge in ways.items():
                seed += 1
                _fill(direct, f"t-bench-{seed}", num_blocks, seed)
                trips = link.round_trips
                started = time.perf_counter()
                erased = purge(slow, f"t-bench-{seed}")
                seconds = time.perf_counter() - started
                assert erased == num_blocks, (erased, num_blocks)
                row = {"seconds": round(seconds, 3), "round_trips": link.round_trips - trips}
                results.setdefault(str(num_blocks), {})[name] = row
                table.add_row(str(num_blocks), name, f"{seconds:.2f}", str(row["round_trips"]))
    finally:
        link.close()
    Console().print(table)
    print(json.dumps({"delay_ms": args.delay_ms, "purge": results}))


if __name__ == "__main__":
    main()
