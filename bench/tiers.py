"""The tiered KV store against this machine's physical limits, in one run.

    python -m bench.tiers [--quick]

1. Limits: raw memcpy bandwidth (torch copy of a large buffer) and raw sequential read bandwidth of a file
   on the disk that holds L3, with its pages dropped from the page cache first.
2. Restore bandwidth: KV bytes per second brought back into the device pool from L2 (host tier → pool
   copy) and from L3 for each codec (read, verify, decode; page cache dropped first). L2 restores a
   chain laid out the way the engine leaves it: L1 evicts leaf-first, so a chain reaches L2 tail first,
   interleaved with other requests' blocks, and comes back into whatever L1 blocks are free (scattered
   slots on both sides, few contiguous runs). ``l2_contiguous`` is the best case, one contiguous copy.
   L3 (and Redis with ``--redis-url``) restores go through the engine's own code: a chain demoted the
   engine's way (tail first, interleaved with another request, through a small L2 whose evictions the
   writer thread stores) is looked up after a restart (``TieredStore.plan_prefetch``), read and decoded
   by a prefetch thread, offered to L2 (``finish_prefetch``) and copied into scattered free L1 blocks
   (``TieredStore.load``), timed from the lookup to the last copy. ``l3_<codec>_contiguous`` is the old
   figure beside it: the chain written as whole files, read file by file, no copy into the pool.
3. TTFT of one prompt (8k tokens; 2k with --quick) whose context is served from L1, L2, L3 (each codec,
   after a worker restart) and recomputed, through the engine.
4. Greedy-token agreement of fp8 and int4 against the exact cache on the built-in model.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench import codec_agreement
from policies.hashing import NamespaceKey, NamespaceSegment, block_hashes
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.model.loader import load_model
from worker.sequence import SamplingParams
from worker.tiers.accuracy import codec_accuracy
from worker.tiers.disk import DiskTier
from worker.tiers.entry import BlockRecord
from worker.tiers.host import DemotedBlock, HostTier
from worker.tiers.remote import RemoteTier
from worker.tiers.store import TierConfig, TieredStore
from worker.tiers.transfer import Copier

CODECS = ("none", "fp8", "int4")
SEGMENT = [
    NamespaceSegment(
        start_token=0, namespace_id="bench", key=NamespaceKey(b"bench-namespace-key-0123456789ab")
    )
]


def drop_page_cache(paths: list[Path]) -> None:
    for path in paths:
        with path.open("rb") as handle:
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def memcpy_gbps(num_bytes: int) -> float:
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(3))
    return num_bytes / best / 1e9


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def disk_read_gbps(directory: Path, num_bytes: int) -> float:
    path = directory / "raw-read.bin"
    chunk = os.urandom(8 << 20)
    with path.open("wb") as handle:
        for _ in range(num_bytes // len(chunk)):
            handle.write(chunk)
        handle.flush()
        os.fsync(handle.fileno())
    drop_page_cache([path])
    buffer = bytearray(8 << 20)
    started = time.perf_counter()
    with path.open("rb", buffering=0) as handle:
        while handle.readinto(buffer):
            pass
    seconds = time.perf_counter() - started
    path.unlink()
    return num_bytes / seconds / 1e9


def _chain(num_blocks: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[DemotedBlock]:
    tokens = [random.randrange(256) for _ in range(num_blocks * shape[2])]
    hashes = block_hashes(tokens, shape[2], b"bench", SEGMENT)
    data = torch.randn(num_blocks, *shape).to(dtype)
    return [
        DemotedBlock(
            record=BlockRecord(
                block_hash=h,
                parent_hash=hashes[k - 1] if k else None,
                token_ids=tuple(tokens[k * shape[2] : (k + 1) * shape[2]]),
            ),
            namespace_id="bench",
            position=k,
            data=data[k],
        )
        for k, h in enumerate(hashes)
    ]


def restore_l2_gbps(shape: tuple[int, ...], dtype: torch.dtype, num_blocks: int) -> float:
    host = HostTier(capacity_blocks=num_blocks, block_shape=shape, dtype=dtype, pin_memory=False)
    chain = _chain(num_blocks, shape, dtype)
    slots = [host.put(b.record, b.namespace_id, b.position, b.data) for b in chain]
    pool = torch.empty((num_blocks + 8, *shape), dtype=dtype)
    copier = Copier(pool)
    best = min(
        _timed(lambda: copier.copy_in(host.data, slots, list(range(num_blocks))).wait()) for _ in range(3)
    )
    copier.close()
    return num_blocks * chain[0].data.numel() * chain[0].data.element_size() / best / 1e9


def restore_l2_chain_gbps(shape: tuple[int, ...], dtype: torch.dtype, num_blocks: int) -> float:
    """L2 → L1 restore of one chain as the engine meets it (see the module docstring, point 2)."""
    host = HostTier(capacity_blocks=2 * num_blocks, block_shape=shape, dtype=dtype, pin_memory=False)
    chain, other = _chain(num_blocks, shape, dtype), _chain(num_blocks, shape, dtype)
    slots = [0] * num_blocks
    for k in range(num_blocks - 1, -1, -1):  # demoted tail first, interleaved with another request
        slot = host.put(chain[k].record, chain[k].namespace_id, chain[k].position, chain[k].data)
        assert slot is not None
        slots[k] = slot
        host.put(other[k].record, other[k].namespace_id, other[k].position, other[k].data)
    pool = torch.empty((4 * num_blocks, *shape), dtype=dtype)
    block_ids = random.Random(7).sample(range(4 * num_blocks), num_blocks)  # free L1 blocks after churn
    copier = Copier(pool)
    best = min(_timed(lambda: copier.copy_in(host.data, slots, block_ids).wait()) for _ in range(3))
    copier.close()
    return num_blocks * chain[0].data.numel() * chain[0].data.element_size() / best / 1e9


def _tiered_store(tiers: TierConfig, pool: torch.Tensor, posted: queue.SimpleQueue) -> TieredStore:
    """The engine's store over a pool of the bench's shape (no prefill speed: every tier is worth it)."""
    return TieredStore(
        tiers,
        fingerprint=b"bench-fingerprint",
        kv_cache=pool,
        bytes_per_block=pool[0].numel() * pool.element_size(),
        prefill_tokens_per_s=lambda: 0.0,
        post=posted.put,
    )


def restore_chain_engine_gbps(
    tiers: TierConfig, shape: tuple[int, ...], dtype: torch.dtype, num_blocks: int, *, repeats: int = 3
) -> dict[str, float]:
    """L3 or Redis → L1 restore of one chain through the engine's code (module docstring, point 2).

    Returns GB/s of KV restored, end to end (``gbps``) and per stage: the prefetch thread's read and
    decode (``fetch_gbps``), the offer to L2 and the copy into the pool (``copy_gbps``).
    """
    pool = torch.empty((4 * num_blocks, *shape), dtype=dtype)
    posted: queue.SimpleQueue = queue.SimpleQueue()
    chain, other = _chain(num_blocks, shape, dtype), _chain(num_blocks, shape, dtype)
    writer = _tiered_store(replace(tiers, l2_bytes=64 * pool[0].numel() * pool.element_size()), pool, posted)
    for k in range(num_blocks - 1, -1, -1):  # L1 evicts leaf-first: tail first, interleaved with another
        for block in (chain[k], other[k]):
            writer.l2.put(block.record, block.namespace_id, block.position, block.data)
        if k % 64 == 0:
            writer.wait_for_writes()  # the bench must not drop demotions as a swamped writer would
    for block in _chain(80, shape, dtype):  # later requests push the chain's last blocks out of L2
        writer.l2.put(block.record, block.namespace_id, block.position, block.data)
    writer.wait_for_writes()
    assert writer.dropped_demotions == 0
    writer.close()
    hashes = [b.record.block_hash for b in chain]
    token_blocks = [list(b.record.token_ids) for b in chain]
    num_bytes = num_blocks * chain[0].data.numel() * chain[0].data.element_size()
    free_blocks = random.Random(7).sample(range(4 * num_blocks), num_blocks)  # free L1 blocks after churn
    best: dict[str, float] = {}
    for attempt in range(repeats):
        big_l2 = replace(  # one namespace may stage half the prefetch budget: room for the whole chain
            tiers,
            l2_bytes=(num_blocks + 16) * pool[0].numel() * pool.element_size(),
            prefetch_bytes=max(tiers.prefetch_bytes, 2 * num_bytes),
        )
        reader = _tiered_store(big_l2, pool, posted)  # a restarted worker: L3 index rebuilt from the files
        if reader.disk is not None:
            drop_page_cache([info.path for info in reader.disk.files.values()])
        started = time.perf_counter()
        plan, _ = reader.plan_prefetch(f"restore-{attempt}", hashes, token_blocks, ["bench"] * num_blocks, 0)
        assert plan is not None, "nothing found to restore"
        reader.start_prefetch(plan)
        _, result = posted.get(timeout=600)
        fetched = time.perf_counter()
        assert len(result.records) == num_blocks, f"restored {len(result.records)} of {num_blocks} blocks"
        reader.finish_prefetch(result)
        reader.load(result.data, list(range(num_blocks)), free_blocks).wait()
        done = time.perf_counter()
        lossless = (tiers.remote_codec if tiers.l3_dir is None else tiers.l3_codec) == "none"
        if lossless:  # the chain really is back, block by block, in the scattered pool blocks
            assert torch.equal(pool[free_blocks], torch.stack([b.data for b in chain]))
        if attempt == repeats - 1 and reader.remote is not None:
            reader.purge_remote("bench")  # leave nothing of the bench in a shared Redis
        reader.close()
        for name, seconds in (("gbps", done - started), ("fetch_gbps", fetched - started)):
            best[name] = max(best.get(name, 0.0), num_bytes / seconds / 1e9)
        best["copy_gbps"] = max(best.get("copy_gbps", 0.0), num_bytes / (done - fetched) / 1e9)
    return best


def restore_remote_gbps(
    tiers: TierConfig, shape: tuple[int, ...], dtype: torch.dtype, num_blocks: int
) -> float:
    """The best case for Redis: the chain written in one go, read back as one run, no copy into a pool."""
    assert tiers.remote_url is not None
    remote = RemoteTier(
        tiers.remote_url,
        fingerprint=b"bench-contiguous",
        codec=tiers.remote_codec,
        block_shape=shape,
        dtype=dtype,
        budget_bytes=tiers.remote_bytes,
        ttl_s=tiers.remote_ttl_s,
        timeout_s=tiers.remote_timeout_s,
    )
    chain = _chain(num_blocks, shape, dtype)
    remote.put(chain)
    args = (["bench"] * num_blocks, [b.record.block_hash for b in chain], [b.record.token_ids for b in chain])
    best = 0.0
    for _ in range(3):
        started = time.perf_counter()
        records, data = remote.get_run(*args)
        seconds = time.perf_counter() - started
        assert len(records) == num_blocks and data is not None
        best = max(best, data.numel() * data.element_size() / seconds / 1e9)
    remote.purge("bench")
    return best


def restore_l3_gbps(
    directory: Path, codec: str, shape: tuple[int, ...], dtype: torch.dtype, num_blocks: int
) -> float:
    disk = DiskTier(
        directory / codec,
        budget_bytes=1 << 40,
        fingerprint=b"bench" * 7,
        codec=codec,
        block_shape=shape,
        dtype=dtype,
        min_free_bytes=0,
    )
    chain = _chain(num_blocks, shape, dtype)
    disk.write(chain)
    found = disk.match([b.record.block_hash for b in chain], [list(b.record.token_ids) for b in chain])
    best = 0.0
    for _ in range(3):
        drop_page_cache([info.path for info in disk.files.values()])
        started = time.perf_counter()
        disk.will_need(list(dict.fromkeys(file_id for file_id, _ in found)))  # what a prefetch does first
        restored = 0
        k = 0
        while k < len(found):
            file_id, first = found[k]
            count = len(disk.files[file_id].records) - first
            _, blocks = disk.read(file_id, first, count)
            restored += blocks.numel() * blocks.element_size()
            k += count
        best = max(best, restored / (time.perf_counter() - started) / 1e9)
    disk.close()
    return best


async def ttft(engine: Engine, rid: str, prompt: list[int]) -> tuple[float, dict]:
    started = time.perf_counter()
    first = None
    usage: dict = {}
    async for out in engine.generate(
        rid, prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), SEGMENT
    ):
        first = first or time.perf_counter()
        if out.finished:
            usage = out.usage or {}
    assert first is not None
    return (first - started) * 1000, usage


def ttft_by_source(model: str, prompt_tokens: int, data_dir: Path, progress: Progress) -> dict[str, float]:
    rng = random.Random(1)
    context = [rng.randrange(256) for _ in range(prompt_tokens - 64)]

    def question() -> list[int]:
        return [rng.randrange(256) for _ in range(64)]

    pool_blocks = (
        int(prompt_tokens / 16 * 1.5) + 16
    )  # one prompt fits, two do not: the second evicts the first
    base = dict(model=model, max_model_len=prompt_tokens + 64, num_blocks=pool_blocks)
    out: dict[str, float] = {}
    task = progress.add_task("TTFT by source", total=3 + 2 * len(CODECS))

    async def main_run() -> None:
        engine = Engine(WorkerConfig(**base, l2_bytes=4 << 30))
        engine.start()
        out["recompute"], _ = await ttft(engine, "cold", context + question())
        progress.advance(task)
        out["l1"], usage = await ttft(engine, "l1", context + question())
        assert usage["cached_tokens_by_source"]["l1"] > 0, usage
        progress.advance(task)
        await ttft(engine, "evictor", [rng.randrange(256) for _ in range(prompt_tokens)])
        out["l2"], usage = await ttft(engine, "l2", context + question())
        assert usage["cached_tokens_by_source"]["l2"] > 0, usage
        progress.advance(task)
        engine.stop()
        for codec in CODECS:
            directory = data_dir / f"l3-{codec}"
            writer = Engine(
                WorkerConfig(**base, l2_bytes=0, l3_dir=directory, l3_codec=codec, l3_min_free_bytes=0)
            )
            writer.start()
            await ttft(writer, f"write-{codec}", context + question())
            writer.stop()  # flushes the cache to disk
            progress.advance(task)
            drop_page_cache(list(directory.rglob("*.kv")))
            reader = Engine(
                WorkerConfig(**base, l2_bytes=0, l3_dir=directory, l3_codec=codec, l3_min_free_bytes=0)
            )
            reader.start()
            out[f"l3_{codec}"], usage = await ttft(reader, f"read-{codec}", context + question())
            assert usage["cached_tokens_by_source"]["l3"] > 0, usage
            reader.stop()
            progress.advance(task)

    asyncio.run(main_run())
    return out


def greedy_agreement(codec: str, quick: bool) -> float:
    loaded = load_model("builtin", dtype=torch.float32, device=torch.device("cpu"))
    text = (
        "You are a helpful assistant that answers questions about Python.\n"
        "Lists are mutable sequences, typically used to store collections of homogeneous items. "
        "Tuples are immutable sequences, typically used to store collections of heterogeneous data. "
        "Dictionaries map hashable keys to arbitrary objects and keep insertion order. "
    ) * 4
    context = loaded.tokenizer.encode(text, add_special_tokens=True)[:512]
    return codec_accuracy(
        loaded.model, context, codec=codec, continuation_tokens=64 if quick else 256
    ).greedy_agreement


def plot(ttft_ms: dict[str, float], restore: dict[str, float], limits: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(
        list(ttft_ms), list(ttft_ms.values()), color=["#888" if k == "recompute" else "#3a7" for k in ttft_ms]
    )
    left.set_yscale("log")
    left.set_ylabel("TTFT (ms, log scale)")
    left.set_title("TTFT by the source of the cached context")
    right.bar(list(restore), list(restore.values()))
    right.axhline(limits["memcpy_gbps"], color="r", linestyle="--", label="memcpy")
    right.axhline(limits["disk_read_gbps"], color="b", linestyle=":", label="raw disk read")
    right.set_ylabel("GB/s of KV restored")
    right.set_title("restore bandwidth")
    right.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="a 2k-token prompt and smaller buffers (under 60 s)"
    )
    parser.add_argument("--model", default="random-bench")
    parser.add_argument("--data-dir", type=Path, default=None, help="where L3 files go (default: a temp dir)")
    parser.add_argument("--plot", type=Path, default=Path("bench/out/tiers.png"))
    parser.add_argument(
        "--redis-url", default=None, help="also restore from this Redis (keys are erased after)"
    )
    args = parser.parse_args()
    console = Console(stderr=True)
    prompt_tokens = 2048 if args.quick else 8192
    buffer_bytes = (64 if args.quick else 512) << 20
    data_dir = Path(tempfile.mkdtemp(prefix="pg-tiers-", dir=args.data_dir))
    model = load_model(args.model, dtype=torch.float32, device=torch.device("cpu"))
    cfg = model.config
    shape = (cfg.num_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim)
    restore_blocks = max(64, buffer_bytes // (4 * torch.Size(shape).numel()) // 4)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("limits and restore bandwidth", total=3 + len(CODECS))
        limits = {"memcpy_gbps": memcpy_gbps(buffer_bytes)}
        progress.advance(task)
        limits["disk_read_gbps"] = disk_read_gbps(data_dir, buffer_bytes)
        progress.advance(task)
        restore = {
            "l2": restore_l2_chain_gbps(shape, torch.float32, restore_blocks),
            "l2_contiguous": restore_l2_gbps(shape, torch.float32, restore_blocks),
        }
        progress.advance(task)
        stages: dict[str, dict[str, float]] = {}
        for codec in CODECS:
            tiers = TierConfig(l3_dir=data_dir / f"engine-{codec}", l3_codec=codec, l3_min_free_bytes=0)
            stages[f"l3_{codec}"] = restore_chain_engine_gbps(tiers, shape, torch.float32, restore_blocks)
            restore[f"l3_{codec}"] = stages[f"l3_{codec}"]["gbps"]
            restore[f"l3_{codec}_contiguous"] = restore_l3_gbps(
                data_dir, codec, shape, torch.float32, restore_blocks
            )
            progress.advance(task)
        if args.redis_url:
            chain_bytes = restore_blocks * 4 * torch.Size(shape).numel()
            tiers = TierConfig(remote_url=args.redis_url, remote_bytes=4 * chain_bytes, remote_timeout_s=5.0)
            stages["remote"] = restore_chain_engine_gbps(tiers, shape, torch.float32, restore_blocks)
            restore["remote"] = stages["remote"]["gbps"]
            restore["remote_contiguous"] = restore_remote_gbps(tiers, shape, torch.float32, restore_blocks)
        ttft_ms = ttft_by_source(args.model, prompt_tokens, data_dir, progress)
        agreement = {codec: greedy_agreement(codec, args.quick) for codec in ("fp8", "int4")}
        others = codec_agreement.measure(quick=True)  # random-init and HF-checkpoint models
    table = Table(
        title=f"tiers ({args.model}, {prompt_tokens}-token prompt, {restore_blocks} blocks restored)"
    )
    for column in ("what", "value", "vs limit"):
        table.add_column(column, justify="right")
    table.add_row("memcpy", f"{limits['memcpy_gbps']:.2f} GB/s", "")
    table.add_row("raw disk read", f"{limits['disk_read_gbps']:.2f} GB/s", "")
    for name, label in (("l2", "restore L2 (engine layout)"), ("l2_contiguous", "restore L2 (contiguous)")):
        table.add_row(
            label, f"{restore[name]:.2f} GB/s", f"{restore[name] / limits['memcpy_gbps']:.0%} of memcpy"
        )
    for codec in CODECS:
        engine, contiguous = restore[f"l3_{codec}"], restore[f"l3_{codec}_contiguous"]
        table.add_row(
            f"restore L3 {codec} (engine path)",
            f"{engine:.2f} GB/s",
            f"{engine / limits['disk_read_gbps']:.0%} of disk read, {engine / contiguous:.2f}x contiguous",
        )
        table.add_row(
            f"restore L3 {codec} (contiguous)",
            f"{contiguous:.2f} GB/s",
            f"{contiguous / limits['disk_read_gbps']:.0%} of disk read",
        )
    if "remote" in restore:
        table.add_row(
            "restore Redis (engine path)",
            f"{restore['remote']:.2f} GB/s",
            f"{restore['remote'] / restore['remote_contiguous']:.2f}x contiguous",
        )
        table.add_row("restore Redis (contiguous)", f"{restore['remote_contiguous']:.2f} GB/s", "")
    for source, ms in ttft_ms.items():
        table.add_row(f"TTFT {source}", f"{ms:.1f} ms", f"{ms / ttft_ms['recompute']:.2f} of recompute")
    for codec, value in agreement.items():
        table.add_row(f"{codec} greedy agreement", f"{value:.4f}", "built-in model")
        for label, by_codec in others.items():
            if label != "builtin":
                table.add_row(
                    f"{codec} greedy agreement", f"{by_codec[codec][0]:.4f}", f"{label} (64 tokens)"
                )
    Console().print(table)
    plot(ttft_ms, restore, limits, args.plot)
    Console().print(f"plot: {args.plot}")
    r3 = lambda d: {k: round(v, 3) for k, v in d.items()}  # noqa: E731
    print(
        json.dumps(
            {
                "limits": r3(limits),
                "restore_gbps": r3(restore),
                "restore_stages_gbps": {k: r3(v) for k, v in stages.items()},
                "ttft_ms": r3(ttft_ms),
                "fp8_greedy_agreement": round(agreement["fp8"], 4),
                "int4_greedy_agreement": round(agreement["int4"], 4),
                "greedy_agreement_by_model": {
                    label: {codec: round(v[0], 4) for codec, v in by_codec.items()}
                    for label, by_codec in others.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
