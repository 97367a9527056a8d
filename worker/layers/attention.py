"""Grouped-query self-attention over the paged KV cache.

The KV cache of all layers is one tensor ``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``:
a block's keys and values for every layer are contiguous, so tiers move one block as one chunk. A
forward pass handles a flat batch of tokens: the decode tokens of several sequences first (one query
each, attended as one padded batch), then prefill chunks (one span per sequence, causal within the span,
full attention to the cached context before it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from worker.layers.rotary import RotaryEmbedding


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's prefill chunk inside the flat batch."""

    query_start: int  # first row of the chunk in the flat batch
    query_len: int  # tokens in the chunk
    context_len: int  # tokens of context after the chunk is written (cached prefix + chunk)
    block_table: torch.Tensor  # [ceil(context_len / block_size)] block ids, long
    mask: torch.Tensor | None = None  # additive causal mask [query_len, context_len], built once per step


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token's KV goes and what each query attends to."""

    slot_blocks: torch.Tensor  # [N] block id receiving each token's KV
    slot_offsets: torch.Tensor  # [N] offset inside that block
    num_decode: int = 0  # the first num_decode rows are single-token decode queries
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks], padded with 0
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_blocks * block_size], True = attend
    prefills: list[PrefillSpan] = field(default_factory=list)


class PagedAttention(nn.Module):
    def __init__(
        self,
        *,
        layer_idx: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.qkv_proj = nn.Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, hidden_size, bias=False)

    def _project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = RotaryEmbedding.apply(q.unflatten(-1, (self.num_heads, self.head_dim)), cos, sin)
        k = RotaryEmbedding.apply(k.unflatten(-1, (self.num_kv_heads, self.head_dim)), cos, sin)
        return q, k, v.unflatten(-1, (self.num_kv_heads, self.head_dim))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """x: [N, hidden] flat batch; writes this layer's KV into ``kv_cache`` and returns [N, hidden]."""
        q, k, v = self._project(x, cos, sin)
        kv_cache[meta.slot_blocks, self.layer_idx, 0, meta.slot_offsets] = k
        kv_cache[meta.slot_blocks, self.layer_idx, 1, meta.slot_offsets] = v
        out = torch.empty_like(q)
        if meta.num_decode:
            out[: meta.num_decode] = self._decode(q[: meta.num_decode], meta, kv_cache)
        for span in meta.prefills:
            rows = slice(span.query_start, span.query_start + span.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], span, kv_cache)
        return self.o_proj(out.flatten(-2))

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        assert meta.decode_block_tables is not None and meta.decode_mask is not None
        kv = kv_cache[meta.decode_block_tables, self.layer_idx]  # [B, nb, 2, bs, kvh, hd]
        batch = kv.shape[0]
        keys = kv[:, :, 0].reshape(batch, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        values = kv[:, :, 1].reshape(batch, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, enable_gqa=True
        )
        return out.squeeze(2)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        span: PrefillSpan,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        if span.context_len == span.query_len:
            # Nothing before the chunk: attend to the chunk's own keys, plain causal.
            keys, values = k.transpose(0, 1), v.transpose(0, 1)
            mask, causal = None, True
        else:
            kv = kv_cache[span.block_table, self.layer_idx]  # [nb, 2, bs, kvh, hd]
            keys = kv[:, 0].reshape(-1, self.num_kv_heads, self.head_dim)[: span.context_len].transpose(0, 1)
            values = (
                kv[:, 1].reshape(-1, self.num_kv_heads, self.head_dim)[: span.context_len].transpose(0, 1)
            )
            if span.mask is None:  # shared by every layer of the step
                offset = span.context_len - span.query_len
                rows = torch.arange(span.query_len, device=q.device)[:, None] + offset
                allowed = torch.arange(span.context_len, device=q.device)[None, :] <= rows
                span.mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(
                    ~allowed, float("-inf")
                )
            mask, causal = span.mask, False
        # A leading batch dimension selects PyTorch's fast CPU kernels (3-D inputs are several times slower).
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys[None],
            values[None],
            attn_mask=mask,
            is_causal=causal,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    def forward_dense(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Cache-free causal attention over [B, T, hidden] (training and reference checks).

        ``kv_transform`` is applied to keys and values [B, T, kv_heads, head_dim] before attending (training
        with simulated KV quantization, so the model tolerates a lossy cache tier).
        """
        q, k, v = self._project(x, cos, sin)
        if kv_transform is not None:
            k, v = kv_transform(k), kv_transform(v)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).flatten(-2))
