"""Continuous batching with chunked prefill.

Every step decodes one token for each running sequence that has finished its prefill, and spends the
rest of a token budget on prefill chunks: first for sequences already prefilling, then for newly admitted
ones. A new request therefore joins while others decode, and a long prompt never stalls decoding for
more than one chunk. When a decode step needs a block and none can be freed, the most recently admitted
sequence is preempted (its blocks released; it is recomputed later, mostly from the prefix cache).

Admission never deadlocks: a waiting sequence that does not fit now is skipped (no head-of-line
blocking), but once it has waited ``max_wait_s`` nothing behind it is admitted, so the running ones drain
and it gets its blocks (aging); when nothing runs, other tenants' reservations yield to it. A sequence
that can never fit the pool is rejected alone.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from policies.hashing import block_hashes, chain_hash, root_hash, segment_at, tokens_to_bytes
from worker.block_manager import BlockManager, NoFreeBlocksError
from worker.purge_fence import PurgeFence
from worker.sequence import Sequence, Status
from worker.tiers.store import TieredStore

log = logging.getLogger("prefixgate.worker")

KV_COPY_FAILED = "KV cache copy failed (the request's cached prefix could not be loaded); retry the request"


@dataclass(slots=True)
class PrefillChunk:
    seq: Sequence
    start: int  # first token of the chunk
    length: int

    @property
    def completes_prefill(self) -> bool:
        return self.start + self.length == self.seq.num_prefill_tokens


@dataclass(slots=True)
class SchedulerOutput:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    rejected: list[tuple[Sequence, str]] = field(default_factory=list)  # finished by the engine with an error
    admitted: list[Sequence] = field(default_factory=list)  # got their blocks in this step

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.length for c in self.prefills)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        model_fingerprint: bytes,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        store: TieredStore | None = None,
        max_wait_s: float = 2.0,
        clock: Callable[[], float],
        purge_fence: PurgeFence | None = None,
    ) -> None:
        """
        Args:
            max_wait_s: after waiting this long a sequence stops being overtaken by later ones.
            purge_fence: blocks of a namespace purged after a sequence arrived are not published.
        """
        self.block_manager = block_manager
        self.store = store
        self.block_size = block_manager.block_size
        self.model_fingerprint = model_fingerprint
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_wait_s = max_wait_s
        self.num_admission_errors = 0  # requests failed because admitting them raised
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._clock = clock
        self._purge_fence = purge_fence

    def now_s(self) -> float:
        return self._clock()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished (or aborted) and free its blocks at once."""
        if seq.transfers:  # a copy still writing into its blocks must end before they are reused
            if self._wait_transfers(seq):
                self._finish_loading(seq)
            else:
                self._drop_failed_load(seq)
        if self.store is not None:
            self.store.drop_prefetched(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.release(seq.block_table)
        seq.block_table = []
        seq.status, seq.finish_reason = Status.FINISHED, reason
        seq.timings.finished_s = self._clock()

    # ---- planning -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for seq in list(self.running):
            if seq.status is Status.LOADING:
                try:
                    loaded = all(t.done() for t in seq.transfers)
                except Exception as exc:  # a failed copy fails its request alone; finish frees its blocks
                    log.error("KV cache copy for request %s failed: %r", seq.request_id, exc)
                    self.running.remove(seq)
                    out.rejected.append((seq, KV_COPY_FAILED))
                    continue
                if loaded:
                    self._finish_loading(seq)
        for seq in list(self.running):
            if seq.status is Status.DECODING and seq in self.running and self._reserve_decode_slot(seq):
                out.decodes.append(seq)
        budget -= len(out.decodes)
        for seq in self.running:
            if budget <= 0:
                break
            if seq.status is Status.PREFILLING:
                budget -= self._plan_chunk(seq, budget, out)
        now = self._clock()
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if seq.prefetching:  # its blocks are still on their way from disk or Redis
                continue
            try:
                admitted = self._admit(seq)
            except Exception as exc:  # one request's bad state must not stop admission for the others
                log.exception("admitting request %s failed", seq.request_id)
                self.num_admission_errors += 1
                self.waiting.remove(seq)
                out.rejected.append((seq, f"engine error: {type(exc).__name__}"))
                continue
            if admitted is None:
                self.waiting.remove(seq)
                out.rejected.append((seq, self._too_large(seq)))
                continue
            if not admitted:
                if now - seq.timings.arrival_s >= self.max_wait_s:
                    break  # aged: the ones behind it wait until it fits
                continue  # does not fit now: try the next ones
            self.waiting.remove(seq)
            self.running.append(seq)
            out.admitted.append(seq)
            if seq.status is Status.PREFILLING:
                budget -= self._plan_chunk(seq, budget, out)
        return out

    def _too_large(self, seq: Sequence) -> str:
        num_blocks = self.block_manager.num_blocks
        return f"request needs {self._num_blocks_needed(seq)} blocks, the pool has {num_blocks}"

    def _num_blocks_needed(self, seq: Sequence) -> int:
        num_prefill = seq.num_tokens - 1 if seq.output_token_ids else seq.num_tokens
        return math.ceil(num_prefill / self.block_size) + 1  # +1: headroom for the first decode block

    def _plan_chunk(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        length = min(budget, seq.num_prefill_tokens - seq.num_computed_tokens)
        out.prefills.append(PrefillChunk(seq=seq, start=seq.num_computed_tokens, length=length))
        return length

    def _admit(self, seq: Sequence) -> bool | None:
        """Match the cached prefix, take references on it and allocate blocks for the rest of the prompt.

        The chain is matched in L1 first, then continued in L2; the L2 part is copied into new L1 blocks
        and the sequence waits in LOADING until the copy is done. Returns False when it does not fit now
        (nothing taken), None when it can never fit the pool.
        """
        bm, bs = self.block_manager, self.block_size
        if self._num_blocks_needed(seq) > bm.num_blocks:
            return None
        # After a preemption the generated tokens (but the last, decoded next) are prefilled again.
        num_prefill = seq.num_tokens - 1 if seq.output_token_ids else seq.num_tokens
        tokens = seq.tokens(0, num_prefill)
        if seq.output_token_ids or len(seq.block_hashes) != num_prefill // bs:
            seq.block_hashes = block_hashes(tokens, bs, self.model_fingerprint, seq.segments)
        matched: list[int] = []
        slots: list[int] = []  # L2 slots continuing the chain after L1
        fetched: list[int] = []  # rows of seq.prefetched continuing it after L2
        if seq.use_cache:
            token_blocks = [tokens[k * bs : (k + 1) * bs] for k in range(len(seq.block_hashes))]
            matched = bm.match_prefix(seq.block_hashes, token_blocks)
            if self.store is not None:
                slots = self.store.match_l2(seq.block_hashes[len(matched) :], token_blocks[len(matched) :])
                fetched = self._match_prefetched(seq, len(matched) + len(slots))
            # Keep at least one token to compute: its logits give the first output token.
            while (len(matched) + len(slots) + len(fetched)) * bs >= num_prefill:
                (fetched or slots or matched).pop()
        bm.acquire(matched)
        if slots:
            self.store.l2.pin(slots)  # type: ignore[union-attr]
        num_new = math.ceil(num_prefill / bs) - len(matched)
        # Reservations protect a tenant's cache, never the pool itself: with nothing running they yield.
        override = not self.running
        if not bm.can_allocate(num_new + 1, seq.namespace_id, ignore_reservations=override):
            bm.release(matched)
            if slots:
                self.store.l2.unpin(slots)  # type: ignore[union-attr]
            return False
        seq.block_table = matched + bm.allocate_many(num_new, seq.namespace_id, ignore_reservations=override)
        seq.num_prefill_tokens = num_prefill
        num_loaded = len(slots) + len(fetched)
        seq.num_computed_tokens = (len(matched) + num_loaded) * bs
        seq.num_published_blocks = len(matched)
        if seq.timings.admitted_s is None:
            self._count_sources(seq, len(matched), num_loaded)
            seq.timings.admitted_s = self._clock()
        seq.status = Status.PREFILLING
        if seq.prefetched is not None and not fetched:  # nothing of it is used: free it now
            self.store.drop_prefetched(seq)  # type: ignore[union-attr]
        if num_loaded:
            assert self.store is not None
            targets = seq.block_table[len(matched) : len(matched) + num_loaded]
            if slots:
                seq.transfers.append(self.store.load(self.store.l2.data, slots, targets[: len(slots)]))
                seq.loading_slots = slots
            if fetched:
                seq.transfers.append(self.store.load(seq.prefetched.data, fetched, targets[len(slots) :]))
            seq.status = Status.LOADING
        return True

    def _match_prefetched(self, seq: Sequence, start: int) -> list[int]:
        """Rows of the sequence's prefetched blocks that continue its chain at block ``start``."""
        fetched = seq.prefetched
        if fetched is None or not (fetched.start <= start < fetched.start + len(fetched.records)):
            return []
        rows = []
        for row in range(start - fetched.start, len(fetched.records)):
            k = fetched.start + row
            if k >= len(seq.block_hashes) or fetched.records[row].block_hash != seq.block_hashes[k]:
                break
            rows.append(row)
        return rows

    def _count_sources(self, seq: Sequence, num_l1: int, num_loaded: int) -> None:
        bs = self.block_size
        by_source = {"l1": num_l1 * bs} if num_l1 else {}
        for k in range(num_l1, num_l1 + num_loaded):
            source = seq.block_origins.get(seq.block_hashes[k], "l2")
            by_source[source] = by_source.get(source, 0) + bs
        if self.store is not None:
            for source, tokens in by_source.items():
                self.store.hits[source] += tokens // bs
        seq.num_cached_tokens = (num_l1 + num_loaded) * bs
        seq.cached_tokens_by_source = by_source

    @staticmethod
    def _wait_transfers(seq: Sequence) -> bool:
        """Wait until every copy into ``seq``'s blocks has ended; returns whether all of them succeeded."""
        ok = True
        for transfer in seq.transfers:
            try:
                transfer.wait()
            except Exception:  # ended all the same: the blocks may be reused
                ok = False
        return ok

    def _drop_failed_load(self, seq: Sequence) -> None:
        """After a failed copy: unpin the L2 slots and free the prefetched blocks; the loaded blocks hold
        garbage, so none of them is published."""
        assert self.store is not None
        self.store.l2.unpin(seq.loading_slots)
        seq.transfers, seq.loading_slots = [], []
        self.store.drop_prefetched(seq)

    def _finish_loading(self, seq: Sequence) -> None:
        assert self.store is not None
        for transfer in seq.transfers:
            self.store.loaded(transfer)
        self.store.l2.unpin(seq.loading_slots)
        seq.transfers, seq.loading_slots = [], []
        self.store.drop_prefetched(seq)
        if seq.status is Status.LOADING:
            seq.status = Status.PREFILLING
            if seq.use_cache:
                self._publish_full_blocks(seq)

    def _reserve_decode_slot(self, seq: Sequence) -> bool:
        """Make sure the block for the next token exists; preempt others (or ``seq``) if it cannot."""
        if seq.num_computed_tokens < len(seq.block_table) * self.block_size:
            return True
        while True:
            try:
                seq.block_table.append(self.block_manager.allocate(seq.namespace_id))
                return True
            except NoFreeBlocksError:
                # The most recently admitted sequence goes back to waiting (never one mid-copy).
                victim = next((s for s in reversed(self.running) if s.status is not Status.LOADING), seq)
                self._preempt(victim)
                if victim is seq:
                    return False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.release(seq.block_table)
        seq.block_table, seq.num_computed_tokens = [], 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- bookkeeping after the model ran ----------------------------------------------------------
    def advance(self, seq: Sequence, num_new_computed: int) -> None:
        """Record that ``num_new_computed`` more tokens of ``seq`` have KV, and publish full blocks."""
        seq.num_computed_tokens += num_new_computed
        if seq.num_computed_tokens >= seq.num_prefill_tokens and seq.status is Status.PREFILLING:
            seq.status = Status.DECODING
        if seq.use_cache:
            self._publish_full_blocks(seq)

    def _publish_full_blocks(self, seq: Sequence) -> None:
        bm, bs = self.block_manager, self.block_size
        full = seq.num_computed_tokens // bs
        while seq.num_published_blocks < full:
            k = seq.num_published_blocks
            block_tokens = seq.tokens(k * bs, (k + 1) * bs)
            if k >= len(seq.block_hashes):  # a generated block: extend the chain
                seg = segment_at(seq.segments, k * bs)
                parent = seq.block_hashes[-1] if k else root_hash(self.model_fingerprint, seg.key)
                key = seg.key if k and seg.start_token == k * bs else None
                seq.block_hashes.append(chain_hash(parent, tokens_to_bytes(block_tokens), key))
            namespace_id = segment_at(seq.segments, k * bs).namespace_id
            fence = self._purge_fence
            if fence is None or not fence.purged_since(namespace_id, seq.purge_tag):
                bm.cache(
                    seq.block_table[k],
                    seq.block_hashes[k],
                    block_tokens,
                    seq.block_hashes[k - 1] if k else None,
                    namespace_id=namespace_id,
                    position=k,
                    request_blocks=len(seq.prompt_token_ids) // bs,
                )
            seq.num_published_blocks += 1
