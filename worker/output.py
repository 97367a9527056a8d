"""What a new token means for its request: stop conditions, the text to stream, and the final usage."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from worker.sequence import Sequence

SOURCES = ("l1", "l2", "l3", "remote")


def append_token(
    seq: Sequence, token: int, *, eos_token_ids: Collection[int], max_model_len: int
) -> str | None:
    """Record ``token`` and return why the request ends now ("stop", "length") or None.

    EOS and stop tokens end it without adding text; a stop string ends it and cuts the text where the
    stop string begins.
    """
    seq.output_token_ids.append(token)
    params = seq.sampling
    if token in params.stop_token_ids or (token in eos_token_ids and not params.ignore_eos):
        return "stop"
    seq.detokenizer.add(token)
    text = seq.detokenizer.text
    if (at := earliest_stop(text, params.stop, seq.emitted_text_len)) is not None:
        seq.detokenizer.text = text[:at]
        return "stop"
    if seq.grammar_complete:
        return "stop"
    if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


def earliest_stop(text: str, stops: Collection[str], emitted_len: int) -> int | None:
    """Where the output is cut: the smallest start of any stop string in ``text``, or None.

    The list's order never matters (one multi-character token can complete two stops at once; OpenAI
    cuts at the first occurrence of any). Text already streamed is not searched again: the hold-back of
    ``take_text_delta`` keeps every possible stop start unsent.
    """
    found = (text.find(stop, max(0, emitted_len - len(stop))) for stop in stops)
    return min((at for at in found if at >= 0), default=None)


def take_text_delta(seq: Sequence, *, finished: bool) -> str:
    """Text not yet sent; while running, text that could still begin a stop string is held back."""
    text = seq.detokenizer.text
    hold = 0 if finished else max((len(s) - 1 for s in seq.sampling.stop), default=0)
    end = max(seq.emitted_text_len, len(text) - hold)
    delta = text[seq.emitted_text_len : end]
    seq.emitted_text_len = end
    return delta


def usage(seq: Sequence, *, prefill_tokens_per_s: float) -> dict[str, Any]:
    """The usage block of a finished request (docs/worker-api.md)."""
    t = seq.timings

    def ms(start: float | None, end: float | None) -> float:
        return round(((end or 0.0) - (start or 0.0)) * 1000, 3)

    saved = seq.num_cached_tokens / prefill_tokens_per_s * 1000 if prefill_tokens_per_s else 0.0
    return {
        "prompt_tokens": len(seq.prompt_token_ids),
        "completion_tokens": len(seq.output_token_ids),
        "cached_tokens": seq.num_cached_tokens,
        "cached_tokens_by_source": dict.fromkeys(SOURCES, 0) | seq.cached_tokens_by_source,
        "recomputed_tokens": len(seq.prompt_token_ids) - seq.num_cached_tokens,
        "queue_ms": ms(t.arrival_s, t.admitted_s),
        "prefill_ms": ms(t.admitted_s, t.first_token_s),
        "ttft_ms": ms(t.arrival_s, t.first_token_s),
        "decode_ms": ms(t.first_token_s, t.finished_s),
        "estimated_saved_prefill_ms": round(saved, 3),
        "preemptions": seq.num_preemptions,
    }
