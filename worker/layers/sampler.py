"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeds."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from worker.sequence import SamplingParams


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row of ``logits`` [rows, vocab] (float32).

    Greedy rows (temperature 0) are decided together; the others one by one, each drawing from its own
    generator when the request gave a seed, so a seeded request samples the same tokens whatever else
    is in the batch.
    """
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if p.temperature <= 0.0:
            continue
        scores = logits[row] / p.temperature
        if 0 < p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest set whose mass reaches top_p (the first token always stays).
            outside = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            sorted_probs = sorted_probs.masked_fill(outside, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        tokens[row] = _draw(probs, logits[row], generator)
    return tokens


def _draw(probs: torch.Tensor, logits: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from ``probs``, or the argmax of ``logits`` when the distribution is degenerate.

    A tiny temperature or top_p (1e-40, 1e-300) or non-finite logits give NaN, infinite or all-zero
    probabilities, on which ``torch.multinomial`` raises: the request would fail, and with it the whole
    step. Greedy is the limit of both parameters, so it is the honest answer.
    """
    total = float(probs.sum())
    if math.isfinite(total) and total > 0.0 and bool(torch.isfinite(probs).all()):
        try:
            return int(torch.multinomial(probs, 1, generator=generator).item())
        except RuntimeError:
            pass
    return int(torch.nan_to_num(logits, nan=float("-inf")).argmax().item())
