"""OpenAI response objects and stream chunks built from worker results."""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from gateway.choices import combined_usage
from gateway.logprobs_format import chat_logprobs, completion_logprobs
from gateway.pipeline import PreparedRequest
from gateway.tool_calls import ToolCallParser, ToolCallStream

TIERS = ("l1", "l2", "l3", "remote")
_MAPPED = {"prompt_tokens", "completion_tokens", "cached_tokens", "cached_tokens_by_source"}


def json_response(
    data: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    """A JSON response serialized with orjson (the stdlib encoder costs ~1 ms per 8k token ids)."""
    return web.Response(
        body=orjson.dumps(data), status=status, content_type="application/json", headers=headers
    )


async def start_event_stream(request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
    """Send the head of a server-sent-events response (chat and completion chunks)."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
    )
    await response.prepare(request)
    return response


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


def _wants_logprobs(prepared: PreparedRequest) -> bool:
    return prepared.sampling.logprobs


def _message(text: str, finish_reason: str, tools: ToolCallParser | None) -> tuple[dict[str, Any], str]:
    """The assistant message of one choice, with its tool calls parsed when tools were offered."""
    content: str | None = text
    calls: list[dict[str, Any]] = []
    if tools is not None:
        content, calls = tools.parse(text)
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        message["tool_calls"] = calls
        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return message, finish_reason


def chat_completion(
    prepared: PreparedRequest, results: list[dict[str, Any]], tools: ToolCallParser | None = None
) -> dict[str, Any]:
    """A chat completion with one choice per worker result (``n``)."""
    model = prepared.model
    choices = []
    for index, result in enumerate(results):
        message, finish_reason = _message(result.get("text", ""), result.get("finish_reason", "stop"), tools)
        logprobs = chat_logprobs(model, result.get("logprobs") or []) if _wants_logprobs(prepared) else None
        choices.append(
            {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        )
    return {
        "id": prepared.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": prepared.model.model_id,
        "system_fingerprint": system_fingerprint(prepared),
        "choices": choices,
        "usage": usage_json(prepared, combined_usage([r.get("usage") or {} for r in results])),
    }


def completion(prepared: PreparedRequest, results: list[dict[str, Any]]) -> dict[str, Any]:
    """A text completion with one choice per worker result (``n``)."""
    model = prepared.model
    choices = [
        {
            "index": index,
            "text": result.get("text", ""),
            "logprobs": completion_logprobs(model, result.get("logprobs") or [])
            if _wants_logprobs(prepared)
            else None,
            "finish_reason": result.get("finish_reason", "stop"),
        }
        for index, result in enumerate(results)
    ]
    return {
        "id": prepared.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": prepared.model.model_id,
        "system_fingerprint": system_fingerprint(prepared),
        "choices": choices,
        "usage": usage_json(prepared, combined_usage([r.get("usage") or {} for r in results])),
    }


class ChunkWriter:
    """Server-sent-event chunks of one streamed response (chat or completion)."""

    def __init__(self, prepared: PreparedRequest, tools: ToolCallParser | None = None) -> None:
        self._prepared = prepared
        self._chat = prepared.endpoint == "chat.completions"
        # Per choice: held-back text that may be a tool call (chat with tools only).
        self._tools = [ToolCallStream(parser=tools) for _ in range(prepared.sampling.n)] if tools else None
        self._base = {
            "id": prepared.request_id,
            "object": "chat.completion.chunk" if self._chat else "text_completion",
            "created": int(time.time()),
            "model": prepared.model.model_id,
            "system_fingerprint": system_fingerprint(prepared),
        }
        self._text_len = [0] * prepared.sampling.n  # characters sent per choice (completions' text_offset)

    @staticmethod
    def sse(data: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(data) + b"\n\n"

    def _choice(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None,
        *,
        role: bool = False,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        wanted = self._prepared.sampling.logprobs and logprobs is not None
        if not self._chat:
            offset = self._text_len[index]
            self._text_len[index] += len(text or "")
            lp = completion_logprobs(self._prepared.model, logprobs, offset) if wanted else None
            return {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        lp = chat_logprobs(self._prepared.model, logprobs) if wanted else None
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}

    def first(self) -> bytes | None:
        """The opening chat chunk of each choice, carrying the role (completions have none)."""
        if not self._chat:
            return None
        n = self._prepared.sampling.n
        return b"".join(
            self.sse({**self._base, "choices": [self._choice(i, "", None, role=True)]}) for i in range(n)
        )

    def delta(self, text: str, index: int = 0, logprobs: list[dict[str, Any]] | None = None) -> bytes:
        if self._tools is not None:
            text = self._tools[index].feed(text)
            if not text and not logprobs:
                return b""
        return self.sse({**self._base, "choices": [self._choice(index, text, None, logprobs=logprobs)]})

    def _tool_calls(self, index: int, finish_reason: str) -> tuple[bytes, str]:
        """The held-back end of a choice: its tool calls (one chunk) or the text it turned out to be."""
        if self._tools is None:
            return b"", finish_reason
        text, calls = self._tools[index].finish()
        out = self.sse({**self._base, "choices": [self._choice(index, text, None)]}) if text else b""
        if not calls:
            return out, finish_reason
        deltas = [{"index": i, **call} for i, call in enumerate(calls)]
        choice = {"index": index, "delta": {"tool_calls": deltas}, "logprobs": None, "finish_reason": None}
        reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return out + self.sse({**self._base, "choices": [choice]}), reason

    def final(self, finish_reason: str, usage: dict[str, Any] | None, index: int = 0) -> bytes:
        """A choice's finishing chunk; with ``usage`` (the last choice to finish), the usage follows: in
        its own chunk with ``choices: []`` when the client asked with ``stream_options.include_usage``,
        else on the finishing chunk itself, so the last chunk always carries
        ``usage.prompt_tokens_details.cached_tokens``."""
        held, finish_reason = self._tool_calls(index, finish_reason)
        finish = {**self._base, "choices": [self._choice(index, None if self._chat else "", finish_reason)]}
        if usage is None:
            return held + self.sse(finish)
        usage_body = usage_json(self._prepared, usage)
        if not self._prepared.include_usage:
            return held + self.sse({**finish, "usage": usage_body})
        return held + self.sse(finish) + self.sse({**self._base, "choices": [], "usage": usage_body})

    @staticmethod
    def error(error: dict[str, Any]) -> bytes:
        return ChunkWriter.sse(error)

    @staticmethod
    def done() -> bytes:
        return b"data: [DONE]\n\n"
