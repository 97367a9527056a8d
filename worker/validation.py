"""What makes a request unservable as given, checked on the event loop before it is queued."""

from __future__ import annotations

from worker.protocol import SEED_MAX, SEED_MIN
from worker.request_io import RequestError
from worker.sequence import SamplingParams


def validate_request(
    prompt_token_ids: list[int], sampling: SamplingParams, *, vocab_size: int, max_model_len: int
) -> None:
    """Raise RequestError (a 400 with its message) for a request that cannot be served as given."""
    if not prompt_token_ids:
        raise RequestError("the prompt must contain at least one token")
    if any(not (0 <= t < vocab_size) for t in prompt_token_ids):
        raise RequestError(f"token ids must be in [0, {vocab_size})")
    if sampling.max_tokens < 1:
        raise RequestError("max_tokens must be at least 1")
    if any(not (0 <= token < vocab_size) for token, _ in sampling.logit_bias):
        raise RequestError(f"logit_bias token ids must be in [0, {vocab_size})")
    if not (0.0 <= sampling.temperature <= 100.0 and 0.0 < sampling.top_p <= 1.0 and sampling.top_k >= 0):
        raise RequestError("temperature must be in [0, 100], top_p in (0, 1], top_k at least 0")
    if sampling.seed is not None and not SEED_MIN <= sampling.seed <= SEED_MAX:
        raise RequestError(f"seed must be in [{SEED_MIN}, {SEED_MAX}]")
    total = len(prompt_token_ids) + sampling.max_tokens
    if total > max_model_len:
        raise RequestError(
            f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({sampling.max_tokens}) "
            f"exceeds the context window of {max_model_len} tokens"
        )
