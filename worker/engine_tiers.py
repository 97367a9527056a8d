"""The engine's side of the tiered KV store: built from the worker config, consulted when a request
arrives (prefetch), fed back on the engine thread when a prefetch lands, purged and flushed.

Split out of ``worker.engine`` (no behaviour change): the engine owns the loop and the requests; how it
uses L2, L3 and Redis lives here. Every function but ``purge_stored`` and ``purge_remote`` runs on the
engine thread (or before it starts, or after it stopped).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from policies.hashing import block_hashes, segment_at
from worker.block_manager import BlockManager
from worker.config import WorkerConfig
from worker.kv_events import KVEventLog
from worker.purge_fence import PurgeFence
from worker.sequence import Sequence
from worker.tiers.remote import RemoteUnavailable
from worker.tiers.store import PrefetchResult, TierConfig, TieredStore

log = logging.getLogger("prefixgate.worker")


def make_store(
    cfg: WorkerConfig,
    *,
    fingerprint: bytes,
    kv_cache: torch.Tensor,
    bytes_per_block: int,
    prefill_tokens_per_s: Callable[[], float],
    post: Callable[[tuple[str, Any]], None],
    kv_events: KVEventLog,
) -> TieredStore | None:
    """The tiers the config asks for (None: no L2, no disk, no Redis)."""
    if cfg.l2_bytes <= 0 and cfg.disk_dir() is None and not cfg.remote_url:
        return None
    tiers = TierConfig(
        l2_bytes=max(cfg.l2_bytes, bytes_per_block),
        prefetch_bytes=cfg.prefetch_bytes,
        l3_dir=cfg.disk_dir(),
        l3_bytes=cfg.l3_bytes,
        l3_codec=cfg.l3_codec,
        l3_min_free_bytes=cfg.l3_min_free_bytes,
        remote_url=cfg.remote_url,
        remote_bytes=cfg.remote_bytes,
        remote_ttl_s=float(cfg.remote_ttl_s),
        remote_timeout_s=cfg.remote_timeout_ms / 1000,
        remote_pause_s=cfg.remote_pause_s,
        remote_codec=cfg.remote_codec,
        eviction_policy=cfg.eviction_policy,
        at_rest_key=cfg.at_rest_key,
    )
    return TieredStore(
        tiers,
        fingerprint=fingerprint,
        kv_cache=kv_cache,
        bytes_per_block=bytes_per_block,
        prefill_tokens_per_s=prefill_tokens_per_s,
        post=post,
        kv_events=kv_events,
    )


def start_prefetch(store: TieredStore, pool: BlockManager, seq: Sequence, *, fingerprint: bytes) -> None:
    """Look the prompt up in every tier now; fetch what only disk or Redis hold while it waits."""
    seq.block_hashes = block_hashes(seq.prompt_token_ids, pool.block_size, fingerprint, seq.segments)
    _prefetch(store, pool, seq, from_block=None)


def resume_prefetches(store: TieredStore, pool: BlockManager, waiting: Iterable[Sequence]) -> None:
    """Plan again what the budget cut off the prefetches of requests still waiting, once their owner has
    room: before, those blocks were recomputed though the budget came back long before their turn."""
    for seq in waiting:
        if (
            seq.prefetch_resume_at is not None
            and not seq.prefetching
            and seq.timings.admitted_s is None
            and store.has_prefetch_room(seq.tenant_tag)
        ):
            _prefetch(store, pool, seq, from_block=seq.prefetch_resume_at)


def _prefetch(store: TieredStore, pool: BlockManager, seq: Sequence, *, from_block: int | None) -> None:
    bs = pool.block_size
    tokens = seq.prompt_token_ids
    token_blocks = [tokens[k * bs : (k + 1) * bs] for k in range(len(seq.block_hashes))]
    namespaces = [segment_at(seq.segments, k * bs).namespace_id for k in range(len(seq.block_hashes))]
    num_l1 = len(pool.match_prefix(seq.block_hashes, token_blocks))
    plan, seq.prefetch_resume_at = store.plan_prefetch(
        seq.request_id,
        seq.block_hashes,
        token_blocks,
        namespaces,
        num_l1,
        owner=seq.tenant_tag,
        from_block=from_block,
    )
    if plan is not None:
        seq.prefetching = True
        seq.prefetch_resume_at = None  # the landing result says where to continue
        store.start_prefetch(plan)


def finish_prefetch(
    store: TieredStore, seq: Sequence | None, result: PrefetchResult, fence: PurgeFence
) -> None:
    """A prefetch landed: offer its blocks to L2 and hand them to the waiting request (if still there).

    Blocks of a namespace purged since the request arrived are dropped (read before the purge erased
    them), with the rest of the run after them.
    """
    if seq is None or seq.is_finished:  # gone (or failed) while it was read: the budget comes back
        store.unstage(result.staged_bytes, result.owner)
        return
    for k, namespace_id in enumerate(result.namespace_ids):
        if fence.purged_since(namespace_id, seq.purge_tag):
            result = result.head(k)
            break
    seq.block_origins.update(store.finish_prefetch(result))
    previous = seq.prefetched
    continues = previous is not None and result.start == previous.start + len(previous.records)
    if not continues:
        store.drop_prefetched(seq)  # (nothing to give back unless ids were reused or it was purged)
    held = result.data.nbytes if result.records and result.data is not None else 0
    store.unstage(result.staged_bytes - held, result.owner)  # the budget was reserved for the whole plan
    if held and continues:  # a resumed prefetch: one run with what the request holds already
        seq.prefetched, seq.staged_bytes = previous.extend(result), seq.staged_bytes + held
    elif held:
        seq.prefetched, seq.staged_bytes = result, held
    elif not continues:
        seq.prefetched, seq.staged_bytes = None, 0
    seq.prefetching = False
    # The whole plan arrived and the budget cut the chain after it: the rest is planned again with room.
    whole = result.resume_at is not None and result.start + len(result.records) == result.resume_at
    seq.prefetch_resume_at = result.resume_at if whole and (continues or held) else None


async def purge_stored(
    store: TieredStore | None, namespace_id: str, erased: dict[str, int], failed: dict[str, str]
) -> None:
    """Erase a namespace from L3 off the engine thread (it waits for the chunk the writer is storing)."""
    if store is None:
        return
    try:
        erased |= await asyncio.to_thread(store.purge_stored, namespace_id)
    except Exception as exc:  # a disk error fails the purge (the caller is told to retry), not the worker
        log.exception("purging namespace %s from L3 failed", namespace_id)
        failed["l3"] = f"{type(exc).__name__}: {exc}"


async def purge_remote(
    store: TieredStore | None, namespace_id: str, erased: dict[str, int], failed: dict[str, str]
) -> None:
    """Erase a namespace from Redis off the engine thread (Redis can be slow); records the outcome."""
    if store is None:
        return
    try:
        remote = await asyncio.to_thread(store.purge_remote, namespace_id)
    except RemoteUnavailable as exc:
        failed["remote"] = str(exc)
    else:
        if remote is not None:
            erased["remote"] = remote


def close_store(store: TieredStore, pool: BlockManager, *, flush: bool) -> None:
    """After the loop stopped: write the cached blocks to disk (if asked) and release the tiers."""
    if flush:
        try:
            log.info("flushed %d cached blocks to the disk tier", store.flush(pool))
        except Exception:
            log.exception("flushing the KV cache to disk failed")
    store.close()
