"""Model shapes with random weights, for tests and benchmarks (no download, no training)."""

from __future__ import annotations

from collections.abc import Mapping

from worker.model.config import ModelConfig
from worker.tokenizer import BYTE_VOCAB_SIZE


def _preset(*, hidden: int, layers: int, heads: int, kv_heads: int, inter: int, max_len: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=max_len,
        attention_bias=False,
        tie_word_embeddings=False,
    )


RANDOM_PRESETS: Mapping[str, ModelConfig] = {
    # Fast enough for the test suite: a few ms per forward.
    "tiny": _preset(hidden=64, layers=2, heads=4, kv_heads=2, inter=128, max_len=4096),
    # The builtin model's shape, untrained.
    "small": _preset(hidden=256, layers=6, heads=8, kv_heads=4, inter=768, max_len=4096),
    # Benchmarks: a 4k-token prefill takes well over 0.2 s on a 2-core CPU.
    "bench": _preset(hidden=512, layers=4, heads=8, kv_heads=2, inter=1536, max_len=32768),
}
