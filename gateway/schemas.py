"""Parsing and validation of OpenAI request bodies into frozen request types.

Unknown fields are accepted and ignored (clients send many); known fields with the wrong type or range
raise ``InvalidRequest`` naming the parameter, as OpenAI does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import orjson

from gateway.errors import InvalidRequest

MAX_TOP_K = 2**31 - 1  # larger values mean "no top-k" anyway; beyond int32 the worker cannot index them
ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
MAX_JSON_DEPTH = 64  # nesting of objects/arrays in a request body (tool schemas included)


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    max_tokens: int | None  # None: the gateway's default, capped by the context window
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatRequest:
    model: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    user: str | None
    prompt_cache_key: str | None


@dataclass(frozen=True, kw_only=True, slots=True)
class CompletionRequest:
    model: str
    prompt: str | tuple[int, ...]  # text, or token ids given by the client
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    user: str | None
    prompt_cache_key: str | None


async def read_json(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_json")
    if _too_deep(data, MAX_JSON_DEPTH):
        raise InvalidRequest(
            f"request body is nested more than {MAX_JSON_DEPTH} levels deep", code="invalid_json"
        )
    return data


def _too_deep(data: Any, max_depth: int) -> bool:
    """Whether ``data`` nests objects/arrays deeper than ``max_depth`` (iterative: no recursion limit
    to hit; checked before any field is read, so templates and hashing never see such input)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value
        for child in children:
            if isinstance(child, dict | list):
                if depth >= max_depth:
                    return True
                stack.append((child, depth + 1))
    return False


def _type_error(name: str, expected: str) -> InvalidRequest:
    return InvalidRequest(f"'{name}' must be {expected}", param=name, code="invalid_type")


def _opt(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], expected: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise _type_error(name, expected)
    if not isinstance(value, kind):
        raise _type_error(name, expected)
    return value


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = _opt(body, name, (int, float), "a number")
    if value is None:
        return default
    if not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be between {low} and {high}", param=name, code="invalid_value")
    return float(value)


def _max_tokens(body: Mapping[str, Any], names: tuple[str, ...]) -> int | None:
    for name in names:
        value = _opt(body, name, int, "an integer")
        if value is not None:
            if value < 1:
                raise InvalidRequest(f"'{name}' must be at least 1", param=name, code="invalid_value")
            return value
    return None


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and all(isinstance(item, str) for item in stop) and len(stop) <= 4:
        return tuple(item for item in stop if item)
    raise _type_error("stop", "a string or a list of at most 4 strings")


def _common(body: Mapping[str, Any], max_token_names: tuple[str, ...]) -> dict[str, Any]:
    model = body.get("model")
    if model is None:
        raise InvalidRequest("'model' is required", param="model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise _type_error("model", "a string")
    n = _opt(body, "n", int, "an integer")
    if n not in (None, 1):
        raise InvalidRequest("only n=1 is supported", param="n", code="invalid_value")
    stream = bool(_opt(body, "stream", bool, "a boolean"))
    options = _opt(body, "stream_options", dict, "an object") or {}
    include_usage = _opt(options, "include_usage", bool, "a boolean")
    top_k = _opt(body, "top_k", int, "an integer") or 0
    if not 0 <= top_k <= MAX_TOP_K:
        raise InvalidRequest(
            f"'top_k' must be between 0 and {MAX_TOP_K}", param="top_k", code="invalid_value"
        )
    seed = _opt(body, "seed", int, "an integer")
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise InvalidRequest("'seed' must fit in 64 bits", param="seed", code="invalid_value")
    sampling = SamplingParams(
        max_tokens=_max_tokens(body, max_token_names),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=top_k,
        seed=seed,
        stop=_stop(body),
        ignore_eos=bool(_opt(body, "ignore_eos", bool, "a boolean")),
    )
    for name in ("presence_penalty", "frequency_penalty"):
        _number(body, name, 0.0, -2.0, 2.0)  # accepted for compatibility; the worker does not apply them
    return {
        "model": model,
        "sampling": sampling,
        "stream": stream,
        "include_usage": bool(include_usage),
        "user": _opt(body, "user", str, "a string"),
        "prompt_cache_key": _opt(body, "prompt_cache_key", str, "a string"),
    }


def _content_text(content: Any, index: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                raise InvalidRequest(
                    f"messages[{index}].content: only text parts are supported",
                    param=f"messages[{index}].content",
                    code="invalid_value",
                )
            if not isinstance(part.get("text"), str):
                raise _type_error(f"messages[{index}].content.text", "a string")
            parts.append(part["text"])
        return "".join(parts)
    raise _type_error(f"messages[{index}].content", "a string or a list of content parts")


def _message(raw: Any, index: int) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise _type_error(f"messages[{index}]", "an object")
    role = raw.get("role")
    if role is not None and not isinstance(role, str):
        raise _type_error(f"messages[{index}].role", "a string")
    if role is None:
        raise InvalidRequest(
            f"messages[{index}].role is required",
            param=f"messages[{index}].role",
            code="missing_required_parameter",
        )
    if role not in ROLES:
        raise InvalidRequest(
            f"messages[{index}].role must be one of {sorted(ROLES)}",
            param=f"messages[{index}].role",
            code="invalid_value",
        )
    message = dict(raw)
    message["role"] = "system" if role == "developer" else role
    message["content"] = _content_text(raw.get("content"), index)
    if message["content"] is None and not raw.get("tool_calls"):
        if role != "assistant":
            raise InvalidRequest(
                f"messages[{index}].content is required",
                param=f"messages[{index}].content",
                code="missing_required_parameter",
            )
        message["content"] = ""
    return message


def parse_chat(body: Mapping[str, Any]) -> ChatRequest:
    common = _common(body, ("max_completion_tokens", "max_tokens"))
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequest("'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise _type_error("messages", "an array of messages")
    if not messages:
        raise InvalidRequest("'messages' must not be empty", param="messages", code="invalid_value")
    tools = _opt(body, "tools", list, "an array of tools")
    if tools is not None and not all(isinstance(tool, dict) for tool in tools):
        raise _type_error("tools", "an array of tool objects")
    if _opt(body, "logprobs", bool, "a boolean"):
        raise InvalidRequest("logprobs are not supported", param="logprobs", code="unsupported_parameter")
    return ChatRequest(
        messages=tuple(_message(raw, index) for index, raw in enumerate(messages)),
        tools=tuple(tools) if tools else None,
        **common,
    )


def _prompt(body: Mapping[str, Any]) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if prompt is None:
        raise InvalidRequest("'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    ):
        return tuple(prompt)
    raise _type_error("prompt", "a string, an array of token ids, or a batch of one of them")


def parse_completion(body: Mapping[str, Any]) -> CompletionRequest:
    common = _common(body, ("max_tokens",))
    if common["sampling"].max_tokens is None:  # OpenAI's /v1/completions default
        common["sampling"] = replace(common["sampling"], max_tokens=16)
    if _opt(body, "echo", bool, "a boolean"):
        raise InvalidRequest("echo is not supported", param="echo", code="unsupported_parameter")
    if body.get("suffix") is not None:
        raise InvalidRequest("suffix is not supported", param="suffix", code="unsupported_parameter")
    if body.get("logprobs") is not None:
        raise InvalidRequest("logprobs are not supported", param="logprobs", code="unsupported_parameter")
    return CompletionRequest(prompt=_prompt(body), **common)
