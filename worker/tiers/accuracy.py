"""How much a lossy codec changes the model's output when a cached context comes back from a tier.

The context is prefilled exactly, its full blocks are encoded and decoded with the codec (what a round
trip through the disk or remote tier does), and the continuation is run twice over the paged KV: once on
the exact context, once on the decoded one. Reported: the share of positions whose greedy (argmax) token
is the same (teacher-forced on the exact model's greedy tokens) and the largest logit difference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from worker.layers.attention import AttentionMetadata, PrefillSpan
from worker.model.llama import LlamaForCausalLM
from worker.tiers.codec import get_codec


@dataclass(frozen=True, kw_only=True, slots=True)
class CodecAccuracy:
    codec: str
    greedy_agreement: float  # share of continuation positions with the same argmax token
    max_logit_error: float
    positions: int


def _prefill(
    model: LlamaForCausalLM, kv: torch.Tensor, ids: torch.Tensor, start: int, block_size: int
) -> torch.Tensor:
    """Logits of ``ids`` at positions ``start``…, attending to the ``start`` tokens already in ``kv``."""
    end = start + len(ids)
    table = torch.arange(math.ceil(end / block_size))
    pos = torch.arange(start, end)
    span = PrefillSpan(query_start=0, query_len=len(ids), context_len=end, block_table=table)
    meta = AttentionMetadata(
        slot_blocks=table[pos // block_size], slot_offsets=pos % block_size, prefills=[span]
    )
    return model.logits(model(ids, pos, meta, kv))


@torch.inference_mode()
def codec_accuracy(
    model: LlamaForCausalLM,
    context: list[int],
    *,
    codec: str,
    continuation_tokens: int = 64,
    block_size: int = 16,
) -> CodecAccuracy:
    cfg = model.config
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    total = len(context) + continuation_tokens
    kv = torch.zeros(
        math.ceil(total / block_size) + 1,
        cfg.num_layers,
        2,
        block_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        dtype=dtype,
        device=device,
    )
    ctx = torch.tensor(context, device=device)
    logits = _prefill(model, kv, ctx, 0, block_size)
    # The exact model's greedy continuation, generated one token at a time.
    tokens = [int(logits[-1].argmax())]
    for _ in range(continuation_tokens - 1):
        step = _prefill(
            model, kv, torch.tensor(tokens[-1:], device=device), len(context) + len(tokens) - 1, block_size
        )
        tokens.append(int(step[-1].argmax()))
    follow = torch.tensor(tokens, device=device)
    full_blocks = len(context) // block_size
    exact_kv = kv.clone()
    exact = _prefill(model, exact_kv, follow, len(context), block_size)
    lossy_kv = kv.clone()
    roundtrip = get_codec(codec)
    blocks = lossy_kv[:full_blocks].cpu()
    encoded = bytearray(b"".join(roundtrip.encode(blocks)))
    decoded = roundtrip.decode(encoded, len(blocks), tuple(blocks.shape[1:]), dtype)
    lossy_kv[:full_blocks] = decoded.to(device)
    lossy = _prefill(model, lossy_kv, follow, len(context), block_size)
    # Compare the prediction at the last context position too (it predicts the first new token).
    exact = torch.cat([logits[-1:], exact[:-1]])
    lossy_first = (
        _prefill(model, lossy_kv.clone(), ctx[-1:], len(context) - 1, block_size) if full_blocks else logits
    )
    lossy = torch.cat([lossy_first[-1:], lossy[:-1]])
    agreement = (exact.argmax(-1) == lossy.argmax(-1)).float().mean().item()
    return CodecAccuracy(
        codec=codec,
        greedy_agreement=agreement,
        max_logit_error=(exact - lossy).abs().max().item(),
        positions=len(tokens),
    )
