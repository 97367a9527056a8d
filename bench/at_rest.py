"""Cost of encryption at rest (AES-256-GCM per namespace) on the disk and Redis tiers, side by side.

    python -m bench.at_rest [--quick] [--redis-url redis://127.0.0.1:6379/15]

Writes and reads the same KV blocks through a real ``DiskTier`` (and ``RemoteTier`` when a Redis URL is
given) without and with an ``AtRestCipher``, alternating the two in each round so that machine noise hits
both alike; reports medians and the encrypted/plain ratio. Reads come from the page cache (the files were
just written), so the ratio is the CPU cost of sealing/opening, the worst case for the cipher: on a cold
disk the read itself dominates. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from worker.tiers.at_rest import AtRestCipher
from worker.tiers.disk import DiskTier
from worker.tiers.entry import BlockRecord
from worker.tiers.host import DemotedBlock

BLOCK_SHAPE = (12, 2, 16, 4, 64)  # layers, k/v, block tokens, kv heads, head dim
DTYPE = torch.float16  # 196,608 bytes per block
FINGERPRINT = b"bench-at-rest-fp" * 2


def make_blocks(namespace_id: str, count: int, seed: int) -> list[DemotedBlock]:
    generator = torch.Generator().manual_seed(seed)
    blocks, parent = [], None
    for i in range(count):
        block_hash = (seed * 1_000_003 + i).to_bytes(8, "little") * 4
        blocks.append(
            DemotedBlock(
                record=BlockRecord(
                    block_hash=block_hash, parent_hash=parent, token_ids=tuple(range(i, i + 16))
                ),
                namespace_id=namespace_id,
                position=i,
                data=torch.randn(BLOCK_SHAPE, generator=generator).to(DTYPE),
            )
        )
        parent = block_hash
    return blocks


def disk_round(root: Path, blocks: list[DemotedBlock], cipher: AtRestCipher | None) -> tuple[float, float]:
    """(write GB/s, read GB/s) of ``blocks`` through a fresh disk tier."""
    tier = DiskTier(
        root, budget_bytes=8 << 30, fingerprint=FINGERPRINT, codec="none", block_shape=BLOCK_SHAPE,
        dtype=DTYPE, min_free_bytes=0, cipher=cipher,
    )  # fmt: skip
    num_bytes = sum(b.data.numel() * b.data.element_size() for b in blocks)
    started = time.perf_counter()
    tier.write(blocks)
    write_s = time.perf_counter() - started
    files = sorted(tier.files.items())
    started = time.perf_counter()
    for file_id, info in files:
        tier.read(file_id, 0, len(info.records))
    read_s = time.perf_counter() - started
    tier.purge(blocks[0].namespace_id)
    tier.close()  # the next round opens the same directory
    return num_bytes / write_s / 1e9, num_bytes / read_s / 1e9


def remote_round(url: str, blocks: list[DemotedBlock], cipher: AtRestCipher | None) -> tuple[float, float]:
    from worker.tiers.remote import RemoteTier

    tier = RemoteTier(
        url, fingerprint=FINGERPRINT, codec="none", block_shape=BLOCK_SHAPE, dtype=DTYPE,
        budget_bytes=2 << 30, ttl_s=120, timeout_s=5.0, cipher=cipher,
    )  # fmt: skip
    num_bytes = sum(b.data.numel() * b.data.element_size() for b in blocks)
    started = time.perf_counter()
    tier.put(blocks)
    write_s = time.perf_counter() - started
    ns = [b.namespace_id for b in blocks]
    hashes = [b.record.block_hash for b in blocks]
    tokens = [list(b.record.token_ids) for b in blocks]
    started = time.perf_counter()
    records, _ = tier.get_run(ns, hashes, tokens)
    read_s = time.perf_counter() - started
    assert len(records) == len(blocks), "remote tier lost blocks during the benchmark"
    tier.purge(blocks[0].namespace_id)
    return num_bytes / write_s / 1e9, num_bytes / read_s / 1e9


def cipher_round(cipher: AtRestCipher, num_bytes: int) -> tuple[float, float]:
    """(seal GB/s, open GB/s) of one entry of ``num_bytes``: the cipher alone, no I/O."""
    entry = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8).numpy().tobytes()
    started = time.perf_counter()
    sealed = cipher.seal("t-bench", entry)
    seal_s = time.perf_counter() - started
    started = time.perf_counter()
    cipher.open(sealed)
    open_s = time.perf_counter() - started
    return num_bytes / seal_s / 1e9, num_bytes / open_s / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 blocks, 3 rounds (default 256 blocks, 5)")
    parser.add_argument("--redis-url", default=None, help="also measure the Redis tier")
    args = parser.parse_args()
    num_blocks, rounds = (64, 3) if args.quick else (256, 5)
    cipher = AtRestCipher("bench-at-rest-secret-0123456789")
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in track(range(rounds), description="rounds"):
            for label, c in (("plain", None), ("aes-gcm", cipher)):  # alternate: noise hits both
                blocks = make_blocks(f"t-bench-{r}", num_blocks, seed=r)
                write, read = disk_round(Path(tmp) / label, blocks, c)
                results.setdefault(f"l3 {label}", {}).setdefault("write", []).append(write)
                results[f"l3 {label}"].setdefault("read", []).append(read)
                if c is not None:
                    write, read = cipher_round(c, 32 * blocks[0].data.numel() * blocks[0].data.element_size())
                    results.setdefault("cipher only", {}).setdefault("write", []).append(write)
                    results["cipher only"].setdefault("read", []).append(read)
                if args.redis_url:
                    write, read = remote_round(args.redis_url, blocks, c)
                    results.setdefault(f"redis {label}", {}).setdefault("write", []).append(write)
                    results[f"redis {label}"].setdefault("read", []).append(read)
    medians = {name: {k: statistics.median(v) for k, v in kv.items()} for name, kv in results.items()}
    ratios = {}
    for tier in ("l3", "redis"):
        if f"{tier} plain" in medians:
            plain, sealed = medians[f"{tier} plain"], medians[f"{tier} aes-gcm"]
            ratios[tier] = {k: sealed[k] / plain[k] for k in ("write", "read")}
    table = Table(
        title=f"Encryption at rest: {num_blocks} blocks of {BLOCK_SHAPE} {DTYPE}, median of {rounds}"
    )
    for column in ("tier", "write GB/s", "read GB/s", "write ratio", "read ratio"):
        table.add_column(column, justify="right")
    for name, m in medians.items():
        tier, label = name.split()
        ratio = ratios.get(tier, {}) if label == "aes-gcm" else {"write": 1.0, "read": 1.0}
        if tier == "cipher":
            ratio = {}
        table.add_row(
            name if name != "cipher only" else "cipher only (seal/open, 32-block entry)",
            f"{m['write']:.3f}",
            f"{m['read']:.3f}",
            f"{ratio['write']:.2f}" if ratio else "",
            f"{ratio['read']:.2f}" if ratio else "",
        )
    Console().print(table)
    print(json.dumps({"blocks": num_blocks, "rounds": rounds, "gbps": medians, "encrypted_to_plain": ratios}))


if __name__ == "__main__":
    main()
