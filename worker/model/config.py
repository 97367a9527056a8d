"""Model architecture spec, read from a Hugging Face ``config.json``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"})


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None  # None, or {"rope_type": "linear"|"llama3", …}
    max_position_embeddings: int
    attention_bias: bool  # biases on q/k/v projections (Qwen2: true)
    tie_word_embeddings: bool
    sliding_window: int | None = None  # Mistral; contexts are capped to it (no rolling window)

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Build from a parsed Hugging Face config.json; raises ValueError for other architectures."""
        architectures = raw.get("architectures") or ["LlamaForCausalLM"]
        architecture = architectures[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architecture!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if rope_type in (None, "default") else {**rope, "rope_type": rope_type}
        default_bias = architecture == "Qwen2ForCausalLM"
        use_sliding = raw.get("use_sliding_window", architecture == "MistralForCausalLM")
        return cls(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            attention_bias=bool(raw.get("attention_bias", default_bias)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_window=int(raw["sliding_window"]) if use_sliding and raw.get("sliding_window") else None,
        )

    def to_hf(self) -> dict[str, Any]:
        """The config.json form (Llama conventions), for models this project writes."""
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}.get(
                self.architecture, "mistral"
            ),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
        }
        if self.rope_scaling:
            out["rope_scaling"] = dict(self.rope_scaling)
        return out

    @property
    def max_context_tokens(self) -> int:
        """Longest context the model supports without a rolling window."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def prefill_flops(self, num_new_tokens: int, num_context_tokens: int = 0) -> float:
        """FLOPs to prefill ``num_new_tokens`` after ``num_context_tokens`` cached ones.

        Projections and MLP cost 2 FLOPs per weight per token; causal attention costs 4·heads·head_dim
        FLOPs per layer for every (query, key) pair a new token attends to. Embedding lookups are free;
        the output head is computed for the last token only.
        """
        n, c = num_new_tokens, num_context_tokens
        attn_proj = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        dense = self.num_layers * (attn_proj + 3 * self.hidden_size * self.intermediate_size)
        pairs = n * c + n * (n + 1) / 2
        attention = 4 * self.num_layers * self.num_heads * self.head_dim * pairs
        return 2.0 * dense * n + attention + 2.0 * self.hidden_size * self.vocab_size

    def num_params(self) -> int:
        """Parameter count (embeddings included once when tied)."""
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + self.hidden_size
