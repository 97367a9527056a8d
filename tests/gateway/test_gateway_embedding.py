"""The near-miss embedder's int8 ONNX graph: same embeddings as the fp32 model, cached, with a fallback."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from gateway.embedding import PromptEmbedder
from tests.gateway.test_gateway_near_miss import embedding_cache  # noqa: F401 - fixture


def sample_heads() -> tuple[list[str], list[str]]:
    """Heads like the gateway embeds (128 prompt tokens, decoded): prompts, then near duplicates of them
    (8 tokens replaced after the first 48, a per-request id)."""
    tokenizer = Tokenizer.from_file(str(Path(__file__).parents[2] / "worker" / "builtin" / "tokenizer.json"))
    rng = random.Random(7)
    texts = [
        "You are the billing assistant of Acme Corp. Request 7f3a-991b at 2026-12-01T05:44:12Z. Be brief.",
        "Summarize the following support ticket for the on-call engineer, then list the next actions.",
        "<|system|>Answer only from the documents below. Document 1: The warranty covers two years.",
    ]
    prompts = [tokenizer.encode(text).ids[:128] for text in texts]
    prompts += [[rng.randrange(1, 250) for _ in range(128)] for _ in range(9)]
    variants = [p[:48] + [rng.randrange(1, 250) for _ in range(8)] + p[56:] for p in prompts]
    return [tokenizer.decode(p) for p in prompts], [tokenizer.decode(v) for v in variants]


def test_int8_graph_embeds_like_the_fp32_model_and_is_cached(embedding_cache):  # noqa: F811
    fast = PromptEmbedder(cache_dir=embedding_cache)
    reference = PromptEmbedder(backend="sentence-transformers")
    bases, variants = sample_heads()
    heads = bases + variants
    ours = np.stack([fast.embed_blocking(head) for head in heads])
    theirs = np.stack([reference.embed_blocking(head) for head in heads])
    assert fast.backend == "onnx-int8" and reference.backend == "sentence-transformers"
    assert float(np.min(np.sum(ours * theirs, axis=1))) >= 0.98  # cosine, both unit norm
    # What near miss relies on: each near duplicate's nearest prompt is its own, under both models.
    n = len(bases)
    own = np.arange(n)
    assert (np.argmax(ours[n:] @ ours[:n].T, axis=1) == own).all()
    assert (np.argmax(theirs[n:] @ theirs[:n].T, axis=1) == own).all()
    graphs = list(embedding_cache.glob("*.int8.onnx"))
    assert len(graphs) == 1
    stamp = graphs[0].stat().st_mtime_ns
    again = PromptEmbedder(cache_dir=embedding_cache)
    assert np.allclose(again.embed_blocking(heads[0]), ours[0], atol=1e-6)
    assert graphs[0].stat().st_mtime_ns == stamp  # loaded from the cache, not exported again
    for embedder in (fast, reference, again):
        embedder.close()


def test_a_corrupt_cached_graph_is_rebuilt(tmp_path, caplog, embedding_cache):  # noqa: F811
    PromptEmbedder(cache_dir=embedding_cache).embed_blocking("warm")  # exported once per session
    (cached,) = embedding_cache.glob("*.int8.onnx")
    graph = tmp_path / cached.name
    graph.write_bytes(cached.read_bytes()[:1000])  # a crash or a full disk left half a file
    with caplog.at_level(logging.WARNING, logger="gateway.embedding_onnx"):
        embedder = PromptEmbedder(cache_dir=tmp_path)
        vector = embedder.embed_blocking("You are a careful assistant.")
    assert "rebuilding" in caplog.text and embedder.backend == "onnx-int8"
    assert abs(float(np.linalg.norm(vector)) - 1) < 1e-4 and graph.stat().st_size > 1_000_000
    embedder.close()


def test_without_a_usable_cache_dir_it_falls_back_to_sentence_transformers(tmp_path, caplog):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the cache dir should be")
    with caplog.at_level(logging.WARNING, logger="gateway.embedding"):
        embedder = PromptEmbedder(cache_dir=blocked)
        vector = embedder.embed_blocking("You are a careful assistant.")
    assert embedder.backend == "sentence-transformers"
    assert "using sentence-transformers" in caplog.text
    assert abs(float(np.linalg.norm(vector)) - 1) < 1e-4
    embedder.close()
