"""Tool calls: parsed from the model's output into OpenAI ``tool_calls``, and enforced for
``tool_choice: "required"`` or a named function by a grammar (worker/structured.py). Under
``tool_choice: "auto"`` with a ``strict`` function among the tools, a grammar lets the model answer text
or calls, and constrains a call once it starts: to an offered function, a strict one's arguments to its
schema (OpenAI's guarantee), the others' to any object (``auto_call_grammar``).

Two output styles, chosen from the chat template as vLLM's parsers are:

- ``hermes`` (Hermes, Qwen 2/2.5/3, and templates with tools support but no known style, such as the
  built-in model's): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call;
- ``llama3_json`` (Llama 3.1/3.2 JSON tool calling): the whole answer is ``{"name": ..., "parameters":
  {...}}`` (optionally after ``<|python_tag|>``), several calls separated by ``;``.

A call whose JSON does not parse or names a function that was not offered (or whose "name" is not a string)
stays text (no invented calls).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.errors import InvalidRequest
from gateway.schemas import ChatRequest
from gateway.structured_output import check_grammar, check_json_schema

log = logging.getLogger(__name__)

HERMES, LLAMA3_JSON = "hermes", "llama3_json"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
# What may lead Llama 3 JSON calls: the blanks _LLAMA3_TEXT skips, no other (str.strip's \r, \xa0 ...):
# an answer the auto grammar took as free text must never parse as calls it did not constrain (r18).
_LEAD = " \t\n"
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
# Compact JSON, as the worker's response_format grammars (llguidance reads options from "x-guidance").
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def template_tool_style(chat_template: str | None) -> str:
    """The tool-call style a chat template teaches its model."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return HERMES
    if _PYTHON_TAG in template or ('"parameters"' in template and "ipython" in template):
        return LLAMA3_JSON
    return HERMES


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolCallParser:
    style: str
    names: frozenset[str]  # functions offered in ``tools``
    single: bool = False  # ``parallel_tool_calls: false``: the first call only (OpenAI answers one)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """``(content, tool_calls)`` of a finished answer; no calls: ``(text, [])``. Never raises: the
        text is model output already generated (and billed), so whatever it holds it is answered."""
        try:
            calls = self._calls(text)[: 1 if self.single else None]
            if not calls:
                return text, []
            before = text[: text.find("<tool_call>")] if self.style == HERMES else ""
            # Only the whitespace that leads into the calls goes: a stream sends the text before it as it
            # comes, and holds back only trailing whitespace (ToolCallStream.feed). Nothing left: null.
            content = before.rstrip() or None  # llama3_json: the whole answer is the calls
            return content, [_openai_call(name, arguments) for name, arguments in calls]
        except Exception:
            log.exception("model output not parsed as tool calls (left as text)")
            return text, []

    def _calls(self, text: str) -> list[tuple[str, Any]]:
        if self.style == HERMES:
            raw = [match.group(1) for match in _HERMES_CALL.finditer(text)]
            keys = ("arguments", "parameters")
        else:
            body = text.lstrip(_LEAD).removeprefix(_PYTHON_TAG).lstrip(_LEAD).rstrip()
            if not body.startswith("{"):
                return []
            raw = [part for part in _split_top_level(body) if part.strip()]
            keys = ("parameters", "arguments")
        calls = []
        for item in raw:
            try:
                value = json.loads(item)
            except (ValueError, RecursionError):  # RecursionError: model output nested too deep
                return []
            if not isinstance(value, dict):
                return []
            name = value.get("name")
            if not isinstance(name, str) or name not in self.names:  # a list or object is not a name
                return []
            arguments = next((value[key] for key in keys if key in value), {})
            calls.append((value["name"], arguments))
        return calls

    def may_start_call(self, text: str, *, after_text: bool = False) -> int | None:
        """Where a tool call may begin in streamed text (hold the rest back), or None. ``after_text``:
        text was sent before ``text``; in llama3_json style the calls are the whole answer, so then
        none may begin (as ``parse`` finds none in an answer that does not start with them)."""
        if self.style == HERMES:
            at = text.find("<tool_call>")
            if at >= 0:
                return at
            for size in range(len("<tool_call>") - 1, 0, -1):  # a marker split across deltas
                if text.endswith("<tool_call>"[:size]):
                    return len(text) - size
            return None
        if after_text:
            return None
        stripped = text.lstrip(_LEAD)
        if not stripped:
            return 0 if text else None
        return 0 if stripped.startswith("{") or _PYTHON_TAG.startswith(stripped[:14]) else None


def _split_top_level(body: str) -> list[str]:
    """Split ``{...}; {...}`` at the semicolons between top-level JSON objects."""
    parts, depth, start, in_string, escaped = [], 0, 0, False, False
    for index, char in enumerate(body):
        if in_string:
            if char == '"' and not escaped:
                in_string = False
            escaped = not escaped and char == "\\"  # of this character: it escapes the next one
            continue
        if char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char == ";" and depth == 0:
            parts.append(body[start:index])
            start = index + 1
    parts.append(body[start:])
    return parts


def _openai_call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": "call_" + secrets.token_hex(12),
        "type": "function",
        "function": {"name": name, "arguments": text},
    }


def _function(tool: Mapping[str, Any], index: int) -> Mapping[str, Any]:
    function = tool.get("function")
    if tool.get("type", "function") != "function" or not isinstance(function, dict):
        raise InvalidRequest(
            f"tools[{index}] must be a function tool", param=f"tools[{index}]", code="invalid_value"
        )
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidRequest(
            f"tools[{index}].function.name is required",
            param=f"tools[{index}].function.name",
            code="invalid_value",
        )
    return function


def tool_names(tools: Sequence[Mapping[str, Any]]) -> frozenset[str]:
    return frozenset(_function(tool, index)["name"] for index, tool in enumerate(tools))


def forced_call_grammar(
    style: str, tools: Sequence[Mapping[str, Any]], tool_choice: Any
) -> dict[str, Any] | None:
    """The worker grammar for ``tool_choice`` ``"required"`` or a named function (else None): exactly one
    call, in the template's style, to an offered function with arguments that fit its schema."""
    if tool_choice in (None, "auto", "none"):
        return None
    functions = [_function(tool, index) for index, tool in enumerate(tools)]
    if isinstance(tool_choice, dict):
        wanted = (tool_choice.get("function") or {}).get("name")
        functions = [f for f in functions if f["name"] == wanted]
        if not functions:
            raise InvalidRequest(
                f"tool_choice names '{wanted}', which is not in tools",
                param="tool_choice",
                code="invalid_value",
            )
    key = "arguments" if style == HERMES else "parameters"
    options = []
    for function in functions:
        parameters = function.get("parameters") or _NO_ARGUMENTS
        check_json_schema(parameters, f"tools[{function['name']}].function.parameters")
        options.append(_call_schema(function["name"], key, parameters))
    call = _json_rule(options)
    if style == HERMES:
        return {"type": "lark", "grammar": f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {call}\n'}
    return {"type": "lark", "grammar": f"start: call\ncall: {call}\n"}


# Hermes text that holds no call marker; the marker (after such text) that opens the first call.
_HERMES_TEXT = r"/(.|\n)+/ & ~/(.|\n)*<tool_call>(.|\n)*/"
_HERMES_OPEN = r"/(.|\n)*<tool_call>\n/ & ~/(.|\n)*<tool_call>(.|\n)*<tool_call>\n/"
# Llama 3 JSON: an answer is calls when it starts with "{" (or the python tag) after _LEAD, else text.
_LLAMA3_TEXT = r"/(.|\n)+/ & ~/[ \t\n]*(\{|<\|python_tag\|>)(.|\n)*/"


def auto_call_grammar(
    style: str, tools: Sequence[Mapping[str, Any]], *, parallel: bool = True
) -> dict[str, Any] | None:
    """The worker grammar for ``tool_choice: "auto"`` when a tool is ``strict`` (else None): free text
    (without a call's start), or text then calls (Hermes; Llama 3 JSON: calls alone), each call to an
    offered function; a strict function's arguments fit its schema, another's are any object. Not
    ``parallel`` (``parallel_tool_calls: false``): one call at most."""
    functions = [_function(tool, index) for index, tool in enumerate(tools)]
    if not any(function.get("strict") is True for function in functions):
        return None
    key = "arguments" if style == HERMES else "parameters"
    options = []
    for function in functions:
        if function.get("strict") is True:
            parameters = function.get("parameters") or _NO_ARGUMENTS
            check_json_schema(parameters, f"tools[{function['name']}].function.parameters")
        else:
            parameters = {"type": "object"}
        options.append(_call_schema(function["name"], key, parameters))
    call = _json_rule(options)
    if style == HERMES:
        return {
            "type": "lark",
            "grammar": (
                f"start: TEXT? | OPEN call CLOSE{' (NEXT call CLOSE)*' if parallel else ''}\n"
                'CLOSE: "\\n</tool_call>"\n'
                'NEXT: "\\n<tool_call>\\n"\n'
                f"TEXT: {_HERMES_TEXT}\nOPEN: {_HERMES_OPEN}\ncall: {call}\n"
            ),
        }
    more = ' ("; " call)*' if parallel else ""
    return {"type": "lark", "grammar": f"start: TEXT? | call{more}\nTEXT: {_LLAMA3_TEXT}\ncall: {call}\n"}


def _call_schema(name: str, key: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, key: parameters},
        "required": ["name", key],
        "additionalProperties": False,
    }


def _json_rule(options: list[dict[str, Any]]) -> str:
    """A Lark ``%json`` rule for one of ``options`` (compact JSON, as the response_format grammars)."""
    schema = dict(options[0]) if len(options) == 1 else {"anyOf": options}
    schema["x-guidance"] = _JSON_OPTIONS
    return f"%json {json.dumps(schema)}"


@dataclass(slots=True)
class ToolCallStream:
    """One streamed choice: text passes through until a tool call may begin; from there it is held
    back and parsed at the end (as tool calls, or flushed as text when it is not one). What it sends
    in all is what ``parser.parse`` of the whole answer gives, whatever the deltas' boundaries."""

    parser: ToolCallParser
    held: str = ""
    sent: list[str] = field(default_factory=list)  # what feed() let through (parsed again at the end)

    def feed(self, text: str) -> str:
        """The part of ``text`` that can be sent now: up to where a call may start, less trailing
        whitespace (a call may follow it, and the whitespace before a call is not content)."""
        held = self.held + text
        at = self.parser.may_start_call(held, after_text=bool(self.sent))
        at = len(held[: len(held) if at is None else at].rstrip())
        self.held = held[at:]
        if at:
            self.sent.append(held[:at])
        return held[:at]

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """``(text still to send, tool calls)`` at the end of the choice: the whole answer parsed once,
        as a non-streamed one is (its content always begins with what was sent)."""
        held, self.held = self.held, ""
        sent = "".join(self.sent)
        content, calls = self.parser.parse(sent + held)
        if not calls:
            return held, []
        content = content or ""
        if not content.startswith(sent):  # cannot happen (feed never sends a call's start): text it is
            log.error("streamed text and tool calls disagree; the held text is sent as text")
            return held, []
        return content[len(sent) :], calls


def request_tools(request: ChatRequest, tool_style: str) -> tuple[ChatRequest, ToolCallParser | None]:
    """The request with its forced-call grammar (``tool_choice`` required/named), or its text-or-call
    grammar (``auto`` with a strict tool, unless a JSON ``response_format`` constrains the answer: then
    that grammar alone, as before), and the parser of its answer (None: no tools, or ``tool_choice:
    "none"``). Compiles the grammars' schemas to check them: run it off the event loop."""
    check_grammar(request.sampling.grammar)
    if not request.tools or request.tool_choice == "none":
        return request, None
    parser = ToolCallParser(
        style=tool_style, names=tool_names(request.tools), single=not request.parallel_tool_calls
    )
    grammar = forced_call_grammar(tool_style, request.tools, request.tool_choice)
    if grammar is None:
        if request.sampling.grammar is None:
            grammar = auto_call_grammar(tool_style, request.tools, parallel=request.parallel_tool_calls)
        if grammar is not None:
            return replace(request, sampling=replace(request.sampling, grammar=grammar)), parser
        return request, parser
    if request.sampling.grammar is not None:
        raise InvalidRequest(
            "'tool_choice' required or named cannot be combined with a JSON 'response_format'",
            param="tool_choice",
            code="invalid_value",
        )
    return replace(request, sampling=replace(request.sampling, grammar=grammar)), parser
