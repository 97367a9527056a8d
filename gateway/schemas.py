"""Parsing and validation of OpenAI request bodies into frozen request types.

Unknown fields are ignored and returned in ``unknown_fields`` for a log line (clients send many); known
fields with the wrong type or range raise ``InvalidRequest`` naming the parameter, as OpenAI does, and so
do values prefixgate cannot honour (``gateway.parameters`` lists which): nothing is silently ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from gateway.errors import ContextLengthExceeded, InvalidRequest
from gateway.json_body import MAX_JSON_DEPTH, read_json  # noqa: F401 - re-exported for the handlers
from gateway.parameters import CHAT, COMPLETIONS, known_names
from gateway.structured_output import check_strict_tools, response_format_grammar

# top_p 0 (OpenAI: the most likely token) as sent on: the worker, vLLM and SGLang take (0, 1], and a
# nucleus this small is that one token (the most likely has at least 1 / vocabulary of the mass).
SMALLEST_TOP_P = 1e-9
MAX_TOP_K = 2**31 - 1  # larger values mean "no top-k" anyway; beyond int32 the worker cannot index them
ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    max_tokens: int | None  # None: the gateway's default, capped by the context window
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    n: int = 1  # choices, each generated separately
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token (completions: its integer ``logprobs``)
    grammar: dict[str, Any] | None = None  # constrained decoding for the worker (response_format)


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
    unknown_fields: tuple[str, ...] = ()
    tool_choice: Any = None  # "auto" | "none" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool = True  # false: at most one call (OpenAI's meaning)


@dataclass(frozen=True, kw_only=True, slots=True)
class CompletionRequest:
    model: str
    prompt: str | tuple[int, ...]  # text, or token ids given by the client
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    user: str | None
    prompt_cache_key: str | None
    unknown_fields: tuple[str, ...] = ()


MAX_N = 8
MAX_TOP_LOGPROBS = 20


_CONTROL = re.compile("[\x00-\x1f\x7f]")


def _printable(value: str | None, name: str) -> str | None:
    """A client-chosen identifier (model, user) is stored with the usage record and shown in reports:
    control characters (NUL above all: PostgreSQL text refuses it) are a 400, not a lost record."""
    if value is not None and _CONTROL.search(value):
        raise InvalidRequest(
            f"'{name}' must not contain control characters", param=name, code="invalid_value"
        )
    return value


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


def _unsupported(name: str, message: str) -> InvalidRequest:
    return InvalidRequest(message, param=name, code="unsupported_parameter")


def _logit_bias(body: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    raw = _opt(body, "logit_bias", dict, "an object mapping token ids to biases")
    if not raw:
        return ()
    if len(raw) > 300:
        raise InvalidRequest(
            "'logit_bias' may hold at most 300 tokens", param="logit_bias", code="invalid_value"
        )
    pairs = []
    for key, bias in raw.items():
        if not (isinstance(key, str) and 0 < len(key) < 10 and key.isascii() and key.isdigit()):
            raise _type_error("logit_bias", "an object whose keys are token ids")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise InvalidRequest(
                "'logit_bias' values must be numbers between -100 and 100",
                param="logit_bias",
                code="invalid_value",
            )
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def _n(body: Mapping[str, Any]) -> int:
    n = _opt(body, "n", int, "an integer")
    if n is None:
        return 1
    if not 1 <= n <= MAX_N:
        raise InvalidRequest(f"'n' must be between 1 and {MAX_N}", param="n", code="invalid_value")
    return n


def _chat_logprobs(body: Mapping[str, Any]) -> tuple[bool, int]:
    logprobs = bool(_opt(body, "logprobs", bool, "a boolean"))
    top = _opt(body, "top_logprobs", int, "an integer")
    if top is None:
        return logprobs, 0
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}",
            param="top_logprobs",
            code="invalid_value",
        )
    if not logprobs:
        raise InvalidRequest(
            "'top_logprobs' requires 'logprobs' to be true", param="top_logprobs", code="invalid_value"
        )
    return logprobs, top


def _completion_logprobs(body: Mapping[str, Any]) -> tuple[bool, int]:
    top = _opt(body, "logprobs", int, "an integer")
    if top is None:
        return False, 0
    if not 0 <= top <= 5:
        raise InvalidRequest("'logprobs' must be between 0 and 5", param="logprobs", code="invalid_value")
    return True, top


def _common(
    body: Mapping[str, Any], max_token_names: tuple[str, ...], logprobs: tuple[bool, int]
) -> dict[str, Any]:
    model = body.get("model")
    if model is None:
        raise InvalidRequest("'model' is required", param="model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise _type_error("model", "a string")
    _printable(model, "model")
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
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or SMALLEST_TOP_P,
        top_k=top_k,
        seed=seed,
        stop=_stop(body),
        ignore_eos=bool(_opt(body, "ignore_eos", bool, "a boolean")),
        n=_n(body),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body),
        logprobs=logprobs[0],
        top_logprobs=logprobs[1],
    )
    return {
        "model": model,
        "sampling": sampling,
        "stream": stream,
        "include_usage": bool(include_usage),
        "user": _printable(_opt(body, "user", str, "a string"), "user"),
        "prompt_cache_key": _opt(body, "prompt_cache_key", str, "a string"),
    }


def _unknown(body: Mapping[str, Any], endpoint: str) -> tuple[str, ...]:
    known = known_names(endpoint)
    return tuple(sorted(str(name) for name in body if name not in known))


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
    for field in ("name", "tool_call_id"):
        if raw.get(field) is not None and not isinstance(raw[field], str):
            raise _type_error(f"messages[{index}].{field}", "a string")
        _printable(raw.get(field), f"messages[{index}].{field}")
    message = dict(raw)
    message["role"] = "system" if role == "developer" else role
    message["content"] = _content_text(raw.get("content"), index)
    _check_tool_calls(raw.get("tool_calls"), index)
    if message["content"] is None and not raw.get("tool_calls"):
        if role != "assistant":
            raise InvalidRequest(
                f"messages[{index}].content is required",
                param=f"messages[{index}].content",
                code="missing_required_parameter",
            )
        message["content"] = ""
    return message


def _check_tool_calls(calls: Any, index: int) -> None:
    """An earlier turn's ``tool_calls``, in OpenAI's shape: chat templates index into it (``tojson`` of a
    missing field would crash them)."""
    if calls is None:
        return
    name = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise _type_error(name, "an array of tool calls")
    for i, call in enumerate(calls):
        at = f"{name}[{i}]"
        if not isinstance(call, dict):
            raise _type_error(at, "an object")
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise _type_error(f"{at}.id", "a string")
        if call.get("type", "function") != "function":
            raise InvalidRequest(f"'{at}.type' must be 'function'", param=f"{at}.type", code="invalid_value")
        function = call.get("function")
        if not isinstance(function, dict):
            raise _type_error(f"{at}.function", "an object with 'name' and 'arguments'")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise _type_error(f"{at}.function.name", "a non-empty string")
        if not isinstance(function.get("arguments"), str | dict):
            raise _type_error(f"{at}.function.arguments", "a string (JSON) or an object")


def _check_tool_parameters(tools: list[dict[str, Any]] | tuple[()]) -> None:
    """``tools[i].function.parameters``: absent/null (no arguments) or a JSON Schema object; ``[]``, ``0``
    or ``""`` must not silently mean "no arguments" (``gateway.tool_calls`` reads them with ``or``)."""
    for index, tool in enumerate(tools):
        function = tool.get("function")
        parameters = function.get("parameters") if isinstance(function, dict) else None
        if parameters is not None and not isinstance(parameters, dict):
            raise _type_error(f"tools[{index}].function.parameters", "a JSON Schema object")


def _reject_if_set(body: Mapping[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        if body.get(name) is not None:
            raise _unsupported(name, f"'{name}' is not supported by prefixgate")


def _tool_choice(body: Mapping[str, Any], has_tools: bool) -> Any:
    """``tool_choice`` as sent (``gateway.tool_calls`` enforces required/named); None without tools."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    named = isinstance(function, dict) and isinstance(function.get("name"), str)
    if choice == "required" or named:
        if not has_tools:
            raise InvalidRequest("'tool_choice' requires 'tools'", param="tool_choice", code="invalid_value")
        return choice
    raise InvalidRequest(
        "'tool_choice' must be 'none', 'auto', 'required' or a named tool",
        param="tool_choice",
        code="invalid_value",
    )


def _response_format(body: Mapping[str, Any]) -> dict[str, Any] | None:
    return response_format_grammar(_opt(body, "response_format", dict, "an object"))


def _chat_extras(body: Mapping[str, Any]) -> None:
    """Parameters with nothing to do in a text-only, non-storing gateway: valid values or a 400."""
    _reject_if_set(
        body,
        (
            "audio",
            "prediction",
            "web_search_options",
            "reasoning_effort",
            "verbosity",
            "functions",
            "function_call",
        ),
    )
    if _opt(body, "store", bool, "a boolean"):
        raise _unsupported("store", "'store': true is not supported (completions are never stored)")
    _opt(body, "metadata", dict, "an object")
    _opt(body, "parallel_tool_calls", bool, "a boolean")
    _printable(_opt(body, "safety_identifier", str, "a string"), "safety_identifier")
    tier = body.get("service_tier")
    if tier not in (None, "auto", "default"):
        raise _unsupported("service_tier", "'service_tier' must be 'auto' or 'default'")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise _unsupported("modalities", "only the 'text' modality is supported")


def parse_chat(body: Mapping[str, Any]) -> ChatRequest:
    common = _common(body, ("max_completion_tokens", "max_tokens"), _chat_logprobs(body))
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
    _check_tool_parameters(tools or ())
    check_strict_tools(tools or ())
    tool_choice = _tool_choice(body, bool(tools))
    grammar = _response_format(body)
    if grammar is not None:
        common["sampling"] = replace(common["sampling"], grammar=grammar)
    _chat_extras(body)
    return ChatRequest(
        messages=tuple(_message(raw, index) for index, raw in enumerate(messages)),
        tools=tuple(tools) if tools else None,
        tool_choice=tool_choice,
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        unknown_fields=_unknown(body, CHAT),
        **common,
    )


def _prompt(body: Mapping[str, Any], max_prompt_ids: int | None) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if prompt is None:
        raise InvalidRequest("'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and max_prompt_ids is not None and len(prompt) > max_prompt_ids:
        raise ContextLengthExceeded(  # from the length: a million ids are never walked to learn it
            f"This model's maximum context length is at most {max_prompt_ids} tokens. However, your "
            f"prompt has {len(prompt)} tokens. Please reduce the length of the prompt.",
            param="prompt",
        )
    # C-speed passes (type() is bool for true/false, so they are refused too): a Python loop over a
    # long list took ~0.2 s per million ids.
    if isinstance(prompt, list) and set(map(type, prompt)) <= {int} and (not prompt or min(prompt) >= 0):
        return tuple(prompt)
    raise _type_error("prompt", "a string, an array of token ids, or a batch of one of them")


def parse_completion(body: Mapping[str, Any], *, max_prompt_ids: int | None = None) -> CompletionRequest:
    """A completions request; ``max_prompt_ids``: the most token ids its prompt may hold (the model's
    context window; None: no bound here), checked before the ids are."""
    common = _common(body, ("max_tokens",), _completion_logprobs(body))
    if common["sampling"].max_tokens is None:  # OpenAI's /v1/completions default
        common["sampling"] = replace(common["sampling"], max_tokens=16)
    if _opt(body, "echo", bool, "a boolean"):
        raise _unsupported("echo", "'echo' is not supported")
    if body.get("suffix") is not None:
        raise _unsupported("suffix", "'suffix' is not supported")
    best_of = _opt(body, "best_of", int, "an integer")
    if best_of is not None and best_of not in (1, common["sampling"].n):
        raise _unsupported("best_of", "'best_of' greater than 'n' is not supported")
    prompt = _prompt(body, max_prompt_ids)
    return CompletionRequest(prompt=prompt, unknown_fields=_unknown(body, COMPLETIONS), **common)
