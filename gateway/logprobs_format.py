"""The worker's per-token logprobs (``{"token_id", "logprob", "top": [[id, logprob], ...]}``) in OpenAI's
two formats: chat's ``logprobs.content`` and the legacy completions ``logprobs`` object."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int]) -> str: ...


def _token(decoder: Decoder, token_id: int) -> tuple[str, list[int]]:
    text = decoder.decode([token_id])
    return text, list(text.encode("utf-8", "surrogatepass"))


def chat_logprobs(decoder: Decoder, entries: Sequence[dict[str, Any]] | None) -> dict[str, Any] | None:
    """``choices[i].logprobs`` of a chat completion (or of one stream chunk)."""
    if entries is None:
        return None
    content = []
    for entry in entries:
        token, raw = _token(decoder, entry["token_id"])
        top = []
        for token_id, logprob in entry.get("top") or ():
            alt, alt_raw = _token(decoder, token_id)
            top.append({"token": alt, "logprob": logprob, "bytes": alt_raw})
        content.append({"token": token, "logprob": entry["logprob"], "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(
    decoder: Decoder, entries: Sequence[dict[str, Any]] | None, text_offset: int = 0
) -> dict[str, Any] | None:
    """``choices[i].logprobs`` of a text completion; ``text_offset`` is where the first token's text
    starts in the completion (non-zero for a stream chunk after the first)."""
    if entries is None:
        return None
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        token, _ = _token(decoder, entry["token_id"])
        tokens.append(token)
        token_logprobs.append(entry["logprob"])
        top_logprobs.append({_token(decoder, t)[0]: lp for t, lp in entry.get("top") or ()})
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }
