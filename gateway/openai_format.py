"""OpenAI response objects and stream chunks built from worker results."""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from gateway.pipeline import PreparedRequest

TIERS = ("l1", "l2", "l3", "remote")
_MAPPED = {"prompt_tokens", "completion_tokens", "cached_tokens", "cached_tokens_by_source"}


def json_response(
    data: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    """A JSON response serialized with orjson (the stdlib encoder costs ~1 ms per 8k token ids)."""
    return web.Response(
        body=orjson.dumps(data), status=status, content_type="application/json", headers=headers
    )


def usage_json(prepared: PreparedRequest, usage: dict[str, Any]) -> dict[str, Any]:
    """OpenAI usage with ``prompt_tokens_details.cached_tokens`` and the ``prefixgate`` breakdown."""
    prompt = int(usage.get("prompt_tokens", len(prepared.prompt_token_ids)))
    completion = int(usage.get("completion_tokens", 0))
    by_source = usage.get("cached_tokens_by_source") or {}
    extra = {key: value for key, value in usage.items() if key not in _MAPPED}
    extra.setdefault("prefill_ms", 0.0)
    extra.setdefault("estimated_saved_prefill_ms", 0.0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(usage.get("cached_tokens", 0))},
        "completion_tokens_details": {"reasoning_tokens": 0},
        "prefixgate": {
            "cached_tokens_by_tier": {tier: int(by_source.get(tier, 0)) for tier in TIERS},
            "near_miss_tokens": prepared.near_miss_tokens(int(usage.get("cached_tokens", 0))),
            "promoted_prefix_tokens": prepared.promotion.reported_prefix_tokens,
            "isolation": prepared.tenant.isolation,
            **extra,
        },
    }


def system_fingerprint(prepared: PreparedRequest) -> str:
    return "fp_" + prepared.model.info.model_fingerprint[:12]


def chat_completion(prepared: PreparedRequest, result: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": prepared.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": prepared.model.model_id,
        "system_fingerprint": system_fingerprint(prepared),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": result.get("text", ""), "refusal": None},
                "logprobs": None,
                "finish_reason": result.get("finish_reason", "stop"),
            }
        ],
        "usage": usage_json(prepared, result.get("usage") or {}),
    }


def completion(prepared: PreparedRequest, result: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": prepared.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": prepared.model.model_id,
        "system_fingerprint": system_fingerprint(prepared),
        "choices": [
            {
                "index": 0,
                "text": result.get("text", ""),
                "logprobs": None,
                "finish_reason": result.get("finish_reason", "stop"),
            }
        ],
        "usage": usage_json(prepared, result.get("usage") or {}),
    }


class ChunkWriter:
    """Server-sent-event chunks of one streamed response (chat or completion)."""

    def __init__(self, prepared: PreparedRequest) -> None:
        self._prepared = prepared
        self._chat = prepared.endpoint == "chat.completions"
        self._base = {
            "id": prepared.request_id,
            "object": "chat.completion.chunk" if self._chat else "text_completion",
            "created": int(time.time()),
            "model": prepared.model.model_id,
            "system_fingerprint": system_fingerprint(prepared),
        }

    @staticmethod
    def sse(data: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(data) + b"\n\n"

    def _choice(self, text: str | None, finish_reason: str | None, *, role: bool = False) -> dict[str, Any]:
        if not self._chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def first(self) -> bytes | None:
        """The opening chat chunk carrying the role (completions have none)."""
        if not self._chat:
            return None
        return self.sse({**self._base, "choices": [self._choice("", None, role=True)]})

    def delta(self, text: str) -> bytes:
        return self.sse({**self._base, "choices": [self._choice(text, None)]})

    def final(self, finish_reason: str, usage: dict[str, Any]) -> bytes:
        """The finishing chunk, then the usage: in its own chunk with ``choices: []`` when the client asked
        with ``stream_options.include_usage``, else on the finishing chunk itself, so the last chunk
        always carries ``usage.prompt_tokens_details.cached_tokens``."""
        usage_body = usage_json(self._prepared, usage)
        finish = {**self._base, "choices": [self._choice(None if self._chat else "", finish_reason)]}
        if not self._prepared.include_usage:
            return self.sse({**finish, "usage": usage_body})
        return self.sse(finish) + self.sse({**self._base, "choices": [], "usage": usage_body})

    @staticmethod
    def error(error: dict[str, Any]) -> bytes:
        return ChunkWriter.sse(error)

    @staticmethod
    def done() -> bytes:
        return b"data: [DONE]\n\n"
