"""The inference engine: a loop thread that schedules, runs the model and streams tokens to asyncio.

aiohttp handlers call ``Engine.generate`` (an async iterator of ``RequestOutput``); the loop thread owns
the scheduler, block manager and model runner, so none of them needs locks. Commands reach the thread
through a queue; outputs come back with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import blake3
import torch

from policies.hashing import NamespaceKey, NamespaceSegment
from worker.admission import WaitingQueue
from worker.block_manager import BlockManager
from worker.config import WorkerConfig, context_that_fits
from worker.engine_tiers import (
    close_store,
    finish_prefetch,
    make_store,
    purge_remote,
    purge_stored,
    resume_prefetches,
    start_prefetch,
)
from worker.histograms import LatencyHistogram
from worker.kv_events import KVEventLog
from worker.kv_events import attach as attach_kv_events
from worker.layers.logits_processors import TokenLogprob
from worker.model.loader import LoadedModel, load_model
from worker.model_runner import ModelRunner, kv_bytes_per_block
from worker.output import append_token, take_text_delta, usage
from worker.purge_fence import PurgeFence
from worker.request_io import (
    CommandFailed,
    Handle,
    RequestError,
    RequestOutput,
    deliver,
    request_id_of,
    set_exception,
    step_seqs,
)
from worker.reservations import ReservationKeeper
from worker.scheduler import Scheduler
from worker.sequence import SamplingParams, Sequence, Status, Timings
from worker.structured import GrammarCompiler, GrammarError
from worker.tokenizer import IncrementalDetokenizer
from worker.validation import validate_request
from worker.watchdog import StepWatchdog

log = logging.getLogger("prefixgate.worker")
STOPPING = "the worker is stopping; nothing was erased here, retry"


def model_fingerprint(loaded: LoadedModel, kv_dtype: torch.dtype, block_size: int) -> bytes:
    """Identity of everything that shapes a block's KV: weights, tokenizer, KV dtype and block size."""
    h = blake3.blake3(b"prefixgate/model-fingerprint/v1")
    h.update(loaded.weights_digest)
    h.update(blake3.blake3(loaded.tokenizer.tokenizer_json.encode()).digest())
    h.update(f"{kv_dtype}|{block_size}".encode())
    return h.digest()


class Engine:
    def __init__(self, config: WorkerConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        self.device = config.resolved_device()
        dtype = config.torch_dtype()
        self.loaded = loaded or load_model(config.model, dtype=dtype, device=self.device)
        self.tokenizer = self.loaded.tokenizer
        model = self.loaded.model
        bytes_per_block = kv_bytes_per_block(model, config.block_size, dtype)
        num_blocks = config.num_blocks or max(16, config.kv_cache_bytes // bytes_per_block)
        max_model_len = context_that_fits(  # before allocating: a misfit fails the start, saying what to set
            config,
            model_context_tokens=self.loaded.config.max_context_tokens,
            num_blocks=num_blocks,
            bytes_per_block=bytes_per_block,
        )
        self.fingerprint = model_fingerprint(self.loaded, dtype, config.block_size)
        self.runner = ModelRunner(
            model, num_blocks=num_blocks, block_size=config.block_size, device=self.device
        )
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.prefill_tokens_per_s = 0.0
        # Before the store: the disk tier announces the files it finds.
        self.kv_events = KVEventLog(config.kv_events_capacity)
        self.store = make_store(
            config,
            fingerprint=self.fingerprint,
            kv_cache=self.runner.kv_cache,
            bytes_per_block=bytes_per_block,
            prefill_tokens_per_s=lambda: self.prefill_tokens_per_s,
            post=self._inbox.put,
            kv_events=self.kv_events,
        )
        self.grammars = GrammarCompiler(self.tokenizer, self.loaded.config.vocab_size)
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            eviction_policy=config.eviction_policy,
            on_evict=self.store.demote_from_l1 if self.store else None,
        )
        attach_kv_events(self.kv_events, self.block_manager, "L1")
        if self.store is not None:
            attach_kv_events(self.kv_events, self.store.l2.index, "L2")
            # L2, L3 and Redis follow L1's grants
            self.block_manager.on_reservations = self.store.set_reservations
        # Idle reservations released; the rest saved beside the disk's files and asked again at start-up.
        self.reservations = ReservationKeeper(
            self.block_manager,
            idle_s=config.reservation_idle_s,
            directory=self.store.disk.dir if self.store is not None and self.store.disk is not None else None,
        )
        self.reservations.restore()
        idle_s = config.reservation_idle_s
        self._idle_wake_s = max(0.05, min(5.0, idle_s / 4)) if idle_s > 0 else None
        self.purge_fence = PurgeFence()
        self._purges: set[asyncio.Future[Any]] = set()  # purges under way (kept while their callers are gone)
        self.scheduler = Scheduler(
            self.block_manager,
            model_fingerprint=self.fingerprint,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            store=self.store,
            max_wait_s=config.max_wait_s,
            clock=time.monotonic,
            purge_fence=self.purge_fence,
        )
        self.max_model_len = max_model_len
        self.bytes_per_block = bytes_per_block
        self.counters: dict[str, int] = {
            "requests_total": 0,
            "requests_aborted": 0,
            "prompt_tokens_total": 0,
            "cached_tokens_total": 0,
            "generated_tokens_total": 0,
            "preemptions_total": 0,
            "engine_errors_total": 0,
        }
        self._handles: dict[str, Handle] = {}
        self._outbox: list[tuple[Handle, RequestOutput]] = []  # filled by the engine thread only
        self._sequences: dict[str, Sequence] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stop_lock = threading.Lock()  # no purge is posted once stop() has begun
        self.waiting_queue = WaitingQueue(
            max_requests=config.max_waiting_requests, max_tokens=config.max_waiting_tokens
        )
        self.watchdog = StepWatchdog(stall_timeout_s=config.watchdog_timeout_s)
        self.queue_time = LatencyHistogram()
        self.ttft = LatencyHistogram()

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._warmup()
        self._thread = threading.Thread(target=self._loop, name="prefixgate-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop, flush the cache to disk and release the tiers (idempotent)."""
        with self._stop_lock:
            if self._stopping:
                return
            self._stopping = True
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._fail_unrun_purges()
        self.reservations.save()  # the latest "last asked" times, for the next start
        if self.store is not None:
            close_store(self.store, self.block_manager, flush=self.config.flush_on_stop)

    def _fail_unrun_purges(self) -> None:
        """The loop is gone: answer the purges it left in the inbox (they erased nothing locally)."""
        while True:
            try:
                command, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command == "purge":
                arg[1].call_soon_threadsafe(set_exception, arg[2], CommandFailed(STOPPING))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def health_problem(self) -> str | None:
        """Why the engine cannot serve (thread gone, or stuck with work pending), or None."""
        if not self.alive:
            return "engine thread is not running"
        return self.watchdog.problem()

    def check_capacity(self, num_prompt_tokens: int) -> None:
        """Raise ``admission.Overloaded`` if a request this long would not be queued now."""
        self.waiting_queue.check(num_prompt_tokens, drain_tokens_per_s=self.prefill_tokens_per_s)

    def _post(self, command: str, arg: Any) -> None:
        self.watchdog.work_arrived()
        self._inbox.put((command, arg))

    # ---- public API (event-loop side) --------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Raise RequestError for a request that cannot be served as given."""
        validate_request(
            prompt_token_ids,
            sampling,
            vocab_size=self.loaded.config.vocab_size,
            max_model_len=self.max_model_len,
        )

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        segments: list[NamespaceSegment],
        *,
        use_cache: bool = True,
        matcher: Any = None,
        owner: str = "",
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request; cancelling the iteration aborts it and frees its blocks.
        ``matcher``: from ``new_matcher`` (made here when the request has a grammar and none is given).
        ``owner``: the tenant tag the gateway names (its prefetch lane and budget share; default the
        namespace of the prompt's private tail).

        Raises:
            RequestError: the request is invalid; admission.Overloaded: the waiting queue is full.
        """
        self.validate(prompt_token_ids, sampling)
        if matcher is None and sampling.grammar is not None:
            matcher = self.new_matcher(sampling)
        if request_id in self._handles:
            raise RequestError(f"request id {request_id!r} is already running")
        num_tokens = len(prompt_token_ids)
        self.waiting_queue.enter(num_tokens, drain_tokens_per_s=self.prefill_tokens_per_s)
        handle = Handle(loop=asyncio.get_running_loop(), outputs=asyncio.Queue(), outbox=self._outbox)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            segments=tuple(segments),
            use_cache=use_cache,
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            timings=Timings(arrival_s=time.monotonic()),
            matcher=matcher,
            owner=owner,
            in_waiting_queue=True,
        )
        self._handles[request_id] = handle
        self._post("add", seq)
        finished = False
        try:
            while not finished:
                output = await handle.outputs.get()
                finished = output.finished
                yield output
        finally:
            self._handles.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def new_matcher(self, sampling: SamplingParams) -> Any:
        """The grammar matcher of a request (None without a grammar); RequestError if it does not compile."""
        if sampling.grammar is None:
            return None
        try:
            return self.grammars.matcher(sampling.grammar)
        except GrammarError as exc:
            raise RequestError(str(exc)) from None

    def abort(self, request_id: str) -> None:
        self._post("abort", request_id)

    def is_running(self, request_id: str) -> bool:
        return request_id in self._handles

    async def purge(self, namespace_id: str) -> tuple[dict[str, int], dict[str, str]]:
        """Erase every cached block of ``namespace_id`` from every tier.

        Returns the blocks erased per tier and, per tier that failed part-way, why (a retry is safe).
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[dict[str, int]] = loop.create_future()
        with self._stop_lock:
            if self._stopping:  # the loop is gone or going: nothing would run it (nor close the fence)
                return {}, {"local": STOPPING}
            self._post("purge", (namespace_id, loop, done))
        # A cancelled caller (client gone) does not stop the erase, nor lower the fence before it ends.
        task = asyncio.ensure_future(self._purge_tiers(namespace_id, done))
        self._purges.add(task)
        task.add_done_callback(self._purges.discard)
        return await asyncio.shield(task)

    async def _purge_tiers(
        self, namespace_id: str, done: asyncio.Future[dict[str, int]]
    ) -> tuple[dict[str, int], dict[str, str]]:
        failed: dict[str, str] = {}
        try:
            try:
                erased = await done
            except CommandFailed as exc:
                erased, failed["local"] = {}, str(exc)
            else:  # L3 and Redis off the engine thread: they wait for the writer, other tenants do not
                await purge_stored(self.store, namespace_id, erased, failed)
            await purge_remote(self.store, namespace_id, erased, failed)
        finally:  # the fence holds until Redis is erased too: a prefetch reading it meanwhile is dropped
            self._post("purge_done", (namespace_id,))
        return erased, failed

    def stats(self) -> dict[str, Any]:
        bm = self.block_manager
        return {
            **self.counters,
            "engine_errors_total": self.counters["engine_errors_total"] + self.scheduler.num_admission_errors,
            "num_blocks_total": bm.num_blocks,
            "num_blocks_free": bm.num_free_blocks,
            "num_blocks_cached": bm.num_cached_blocks,
            "num_blocks_in_use": bm.num_blocks - bm.num_free_blocks - bm.num_evictable_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_queued": self.waiting_queue.num_requests,
            "num_queued_tokens": self.waiting_queue.num_tokens,
            "requests_rejected_overloaded": self.waiting_queue.num_rejected,
            "histograms": {
                "queue_time_seconds": self.queue_time.snapshot(),
                "ttft_seconds": self.ttft.snapshot(),
            },
            "evictions_total": bm.num_evictions,
            "eviction_policy": bm.policy.name,
            "reserved_blocks": dict(bm.reserved_blocks),  # granted (a fair share of what was asked)
            "reserved_blocks_requested": dict(bm.requested_blocks),
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 1),
            "tiers": self.store.stats() if self.store is not None else {},
        }

    # ---- engine thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        idle = False
        while not self._stopping:
            block = not self.scheduler.has_work
            if block:
                self.watchdog.idle()
            # Work that only waits on a copy or a prefetch: sleep on the inbox briefly instead of spinning.
            # No work: still wake now and then to release idle reservations (``_idle_wake_s`` None: never).
            timeout = self._idle_wake_s if block else (0.0005 if idle else None)
            try:
                while True:
                    command, arg = self._inbox.get(block=block or timeout is not None, timeout=timeout)
                    block, timeout = False, None
                    if command == "stop":
                        return
                    self.watchdog.progress()  # the clock runs from here if the command never returns
                    self._run_command(command, arg)
                    self.watchdog.progress()
            except queue.Empty:
                pass
            self.reservations.tick()
            if self.scheduler.has_work:
                if self.store is not None:  # budget given back since: waiting requests' cut prefetches
                    resume_prefetches(self.store, self.block_manager, self.scheduler.waiting)
                try:
                    idle = not self._step()
                except Exception as exc:  # a bug must fail requests, never kill the worker
                    log.exception("engine step failed")
                    self.counters["engine_errors_total"] += 1
                    self._fail_all(f"engine error: {type(exc).__name__}")
                self.watchdog.progress()
            self._flush_outputs()

    def _flush_outputs(self) -> None:
        """Hand this iteration's outputs to the event loop in one wake-up (not one per token)."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Handle, RequestOutput]]] = {}
        for handle, output in self._outbox:
            by_loop.setdefault(handle.loop, []).append((handle, output))
        self._outbox.clear()
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(deliver, batch)

    def _run_command(self, command: str, arg: Any) -> None:
        """Run one command; an exception fails only the request (or purge) it concerns."""
        try:
            self._handle_command(command, arg)
        except Exception as exc:
            self.counters["engine_errors_total"] += 1
            message = f"engine error in {command}: {type(exc).__name__}"
            if command == "add":
                log.exception("engine command add failed for request %s", arg.request_id)
                self._fail(arg, message)
            elif command == "purge":
                log.exception("engine command purge failed for namespace %s", arg[0])
                arg[1].call_soon_threadsafe(set_exception, arg[2], CommandFailed(message))
            else:
                log.exception("engine command %s failed (request %s)", command, request_id_of(arg))
                seq = self._sequences.get(arg) if isinstance(arg, str) else None
                if seq is not None:
                    self._fail(seq, message)

    def _handle_command(self, command: str, arg: Any) -> None:
        if command == "add":
            seq: Sequence = arg
            if seq.request_id not in self._handles:  # cancelled before it arrived
                self._leave_queue(seq)
                return
            for segment in seq.segments:  # 0 releases a reservation its owner no longer asks for
                self.reservations.ask(segment.namespace_id, segment.reserved_blocks)
            self._sequences[seq.request_id] = seq
            seq.purge_tag = self.purge_fence.tag()
            if seq.use_cache and self.store is not None:
                start_prefetch(self.store, self.block_manager, seq, fingerprint=self.fingerprint)
            self.scheduler.add(seq)
            self.counters["requests_total"] += 1
            self.counters["prompt_tokens_total"] += len(seq.prompt_token_ids)
        elif command == "prefetched":
            if self.store is not None:
                finish_prefetch(self.store, self._sequences.get(arg.request_id), arg, self.purge_fence)
        elif command == "purge":
            namespace_id, loop, done = arg
            self.purge_fence.purge_started(namespace_id)
            for seq in self._sequences.values():  # what waiting requests prefetched of it is dropped too
                fetched = seq.prefetched if seq.status is Status.WAITING else None
                if fetched is not None and namespace_id in fetched.namespace_ids:
                    self.store.drop_prefetched(seq)  # type: ignore[union-attr]
            erased = {"l1": self.block_manager.purge(namespace_id)}
            if self.store is not None:
                erased |= self.store.purge_local(namespace_id)
            loop.call_soon_threadsafe(done.set_result, erased)
        elif command == "purge_done":
            live_tags = (seq.purge_tag for seq in self._sequences.values())
            self.purge_fence.purge_done(arg[0], live_tags)
        elif command == "abort":
            seq = self._sequences.pop(arg, None)
            if seq is not None and not seq.is_finished:
                self._leave_queue(seq)
                self.scheduler.finish(seq, "abort")
                self.runner.forget(seq)
                self.counters["requests_aborted"] += 1

    def _step(self) -> bool:
        """Run one engine step; returns False when nothing could run (waiting on I/O)."""
        step = self.scheduler.schedule()
        for seq, why in step.rejected:
            self._finish(seq, "error", error=why)
        for seq in step.admitted:
            if seq.in_waiting_queue:  # first admission (not after a preemption)
                self._leave_queue(seq)
                self.queue_time.observe(self.scheduler.now_s() - seq.timings.arrival_s)
        if step.is_empty:
            return False
        started = time.perf_counter()
        try:
            result = self.runner.execute(step)
        except Exception as exc:  # fails the requests of this step only; the waiting ones are untouched
            log.exception("model step failed for requests %s", [s.request_id for s in step_seqs(step)])
            self.counters["engine_errors_total"] += 1
            for seq in step_seqs(step):
                self._fail(seq, f"engine error: {type(exc).__name__}")
            return True
        elapsed = time.perf_counter() - started
        if result.num_prefill_tokens >= 64:
            rate = result.num_prefill_tokens / elapsed
            self.prefill_tokens_per_s = (
                rate if not self.prefill_tokens_per_s else 0.8 * self.prefill_tokens_per_s + 0.2 * rate
            )
        advances = [(seq, 1) for seq in step.decodes] + [(c.seq, c.length) for c in step.prefills]
        for seq, num_tokens in advances:
            self._isolated(seq, self.scheduler.advance, seq, num_tokens)
        now = time.monotonic()
        for seq, token in result.sampled.items():
            if seq.is_finished:  # failed above
                continue
            if seq.timings.first_token_s is None:
                seq.timings.first_token_s = now
                self.ttft.observe(now - seq.timings.arrival_s)
                self.counters["cached_tokens_total"] += seq.num_cached_tokens
            self._isolated(seq, self._append_token, seq, token, result.logprobs.get(seq))
        return True

    def _isolated(self, seq: Sequence, fn: Any, *args: Any) -> None:
        """Run per-request bookkeeping; an exception fails that request alone."""
        try:
            fn(*args)
        except Exception as exc:
            log.exception("engine failed request %s", seq.request_id)
            self.counters["engine_errors_total"] += 1
            self._fail(seq, f"engine error: {type(exc).__name__}")

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> None:
        self.counters["generated_tokens_total"] += 1
        # A token that ends the request without text (EOS, a stop token) has no logprob entry, as OpenAI.
        ends_silently = token in seq.sampling.stop_token_ids or (
            token in self.tokenizer.eos_token_ids and not seq.sampling.ignore_eos
        )
        logprobs = [logprob.to_json()] if logprob is not None and not ends_silently else None
        reason = append_token(
            seq, token, eos_token_ids=self.tokenizer.eos_token_ids, max_model_len=self.max_model_len
        )
        delta = take_text_delta(seq, finished=reason is not None)
        handle = self._handles.get(seq.request_id)
        if reason is None:
            if handle is not None:
                # The first token carries the prompt's usage (cached tokens by tier): a stream cut later
                # is still billed its prompt as it was served.
                first = len(seq.output_token_ids) == 1
                prompt_usage = usage(seq, prefill_tokens_per_s=self.prefill_tokens_per_s) if first else None
                handle.push(
                    RequestOutput(
                        request_id=seq.request_id,
                        text=delta,
                        token_ids=[token],
                        usage=prompt_usage,
                        logprobs=logprobs,
                    )
                )
            return
        self.scheduler.finish(seq, reason)
        self._sequences.pop(seq.request_id, None)
        self.runner.forget(seq)
        self.counters["preemptions_total"] += seq.num_preemptions
        if handle is not None:
            final = usage(seq, prefill_tokens_per_s=self.prefill_tokens_per_s)
            handle.push(
                RequestOutput(
                    request_id=seq.request_id,
                    text=delta,
                    token_ids=[token],
                    finished=True,
                    finish_reason=reason,
                    usage=final,
                    logprobs=logprobs,
                )
            )

    def _leave_queue(self, seq: Sequence) -> None:
        if seq.in_waiting_queue:
            seq.in_waiting_queue = False
            self.waiting_queue.leave(len(seq.prompt_token_ids))

    def _fail(self, seq: Sequence, message: str) -> None:
        """Fail one request whatever state it is in; the cleanup itself must not raise."""
        try:
            self._finish(seq, "error", error=message)
        except Exception:
            log.exception("cleaning up failed request %s", seq.request_id)
            self._sequences.pop(seq.request_id, None)  # a prefetch landing later is given back, not held
            for queue_ in (self.scheduler.running, self.scheduler.waiting):
                if seq in queue_:
                    queue_.remove(seq)
            seq.status = Status.FINISHED
            if self.store is not None:
                self.store.drop_prefetched(seq)  # its share of the prefetch budget comes back
            handle = self._handles.get(seq.request_id)
            if handle is not None:
                output = RequestOutput(request_id=seq.request_id, finished=True, finish_reason="error")
                output.error = message
                handle.push(output)

    def _finish(self, seq: Sequence, reason: str, *, error: str) -> None:
        self._leave_queue(seq)
        self._sequences.pop(seq.request_id, None)
        if seq.is_finished:
            return
        self.scheduler.finish(seq, reason)
        self.runner.forget(seq)
        handle = self._handles.get(seq.request_id)
        if handle is not None:
            handle.push(
                RequestOutput(request_id=seq.request_id, finished=True, finish_reason=reason, error=error)
            )

    def _fail_all(self, message: str) -> None:
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._fail(seq, message)

    def _warmup(self) -> None:
        """One uncached prefill before serving: warms kernels and measures the prefill speed."""
        length = min(256, self.max_model_len - 2)
        key = NamespaceKey(os.urandom(32))
        for _ in range(2):
            seq = Sequence(
                request_id="warmup",
                prompt_token_ids=[t % 256 for t in range(length)],
                sampling=SamplingParams(max_tokens=1, temperature=0.0),
                segments=(NamespaceSegment(start_token=0, namespace_id="warmup", key=key),),
                use_cache=False,
                detokenizer=IncrementalDetokenizer(self.tokenizer),
                timings=Timings(arrival_s=time.monotonic()),
            )
            self.scheduler.add(seq)
            started = time.perf_counter()
            while seq.status is not Status.DECODING:
                step = self.scheduler.schedule()
                self.runner.execute(step)
                for chunk in step.prefills:
                    self.scheduler.advance(chunk.seq, chunk.length)
            self.prefill_tokens_per_s = length / (time.perf_counter() - started)
            self.scheduler.finish(seq, "warmup")
            self.runner.forget(seq)
