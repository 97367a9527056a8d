"""Llama-architecture decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from worker.layers.attention import AttentionMetadata, PagedAttention
from worker.layers.mlp import SwiGLU
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RotaryEmbedding
from worker.model.config import ModelConfig

KVTransform = Callable[[torch.Tensor], torch.Tensor]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = PagedAttention(
            layer_idx=layer_idx,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            bias=cfg.attention_bias,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_dense(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_transform: KVTransform | None = None
    ) -> torch.Tensor:
        x = x + self.self_attn.forward_dense(self.input_layernorm(x), cos, sin, kv_transform)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """The decoder; ``forward`` runs a flat paged batch, ``forward_dense`` a plain causal batch."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output head when the config says so (again after ``to_empty``)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions: [N]. Returns final hidden states [N, hidden] (call ``logits`` on rows)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, meta, kv_cache)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for selected hidden rows."""
        return self.lm_head(hidden).float()

    def forward_dense(self, input_ids: torch.Tensor, kv_transform: KVTransform | None = None) -> torch.Tensor:
        """input_ids: [B, T] from position 0. Returns float32 logits [B, T, vocab].

        ``kv_transform`` alters every layer's keys and values (training against a lossy KV codec).
        """
        x = self.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer.forward_dense(x, cos, sin, kv_transform)
        return self.logits(self.norm(x))
