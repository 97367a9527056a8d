"""What happens to the logits between the model and the sampler: penalties, logit bias, logprobs.

Kept apart from ``sampler.sample`` (which only draws tokens) so that each step is a small function tested
on its own tensors. Rows whose request asks for none of this are not touched (no cost for them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.sequence import SamplingParams


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenLogprob:
    """The chosen token's log-probability and the most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first

    def to_json(self) -> dict[str, object]:
        return {"token_id": self.token_id, "logprob": self.logprob, "top": [list(pair) for pair in self.top]}


def apply_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]]
) -> torch.Tensor:
    """OpenAI's presence and frequency penalties, in place, over each row's generated tokens:
    ``logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty``."""
    vocab = logits.shape[-1]
    for row, (p, output) in enumerate(zip(params, outputs, strict=True)):
        if not output or (p.presence_penalty == 0.0 and p.frequency_penalty == 0.0):
            continue
        ids = torch.tensor(output, dtype=torch.long, device=logits.device)
        counts = torch.bincount(ids, minlength=vocab)[:vocab].to(logits.dtype)
        logits[row] -= counts * p.frequency_penalty + (counts > 0).to(logits.dtype) * p.presence_penalty
    return logits


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Add each request's ``logit_bias`` to its row, in place (ids were checked against the vocabulary)."""
    for row, p in enumerate(params):
        if not p.logit_bias:
            continue
        ids = torch.tensor([token for token, _ in p.logit_bias], dtype=torch.long, device=logits.device)
        bias = torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype, device=logits.device)
        logits[row].index_add_(0, ids, bias)
    return logits


def process_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Penalties then logit bias: the distribution the sampler draws from and logprobs report."""
    return apply_logit_bias(apply_penalties(logits, params, outputs), params)


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], params: Sequence[SamplingParams]
) -> list[TokenLogprob | None]:
    """Log-probabilities of the sampled tokens under the processed logits (before temperature,
    top-k and top-p, as vLLM and OpenAI report them), for the rows that asked (``logprobs`` set)."""
    rows = [row for row, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(params)
    if not rows:
        return result
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    num_top = max(params[row].logprobs or 0 for row in rows)
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (None, None)
    chosen = logprobs.gather(1, torch.tensor([[tokens[r]] for r in rows], device=logits.device))
    chosen_list = chosen.squeeze(1).tolist()
    for i, row in enumerate(rows):
        k = params[row].logprobs or 0
        top: tuple[tuple[int, float], ...] = ()
        if k and top_values is not None and top_ids is not None:
            pairs = zip(top_ids[i, :k].tolist(), top_values[i, :k].tolist(), strict=True)
            top = tuple((t, v) for t, v in pairs if v != float("-inf"))  # masked tokens are no alternative
        result[row] = TokenLogprob(token_id=tokens[row], logprob=chosen_list[i], top=top)
    return result
