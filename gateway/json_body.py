"""Request bodies to JSON without stalling the event loop.

A body within ``max_body_bytes`` can still hold a million tiny values (``[[],[],…]``), and building
them is the expensive part: each container is a tracked object, and the garbage collector's passes
over millions of them, plus any per-node walk in Python, took seconds on the loop while every other
tenant waited. So the body's *shape* is measured first on its bytes, with C-speed counts only
(``bytes.count``/``replace``/``split``/``translate``, no per-character Python), and a body with too many
strings, containers or values, or nested too deep, is a 400 before anything is built; the parse itself
runs with the collector paused (it only allocates, so there is no cycle to find).
"""

from __future__ import annotations

import gc
from typing import Any

import orjson

from gateway.errors import InvalidRequest

MAX_JSON_DEPTH = 64  # nesting of objects/arrays (tool schemas included)
MAX_JSON_CONTAINERS = 50_000  # objects + arrays: a long chat with tools holds a few thousand
MAX_JSON_STRINGS = 200_000  # strings, object keys included
MAX_JSON_VALUES = 1_000_000  # array elements + object members (a token-id prompt: one per token)

_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _invalid(message: str) -> InvalidRequest:
    return InvalidRequest(f"request body is not valid JSON: {message}", code="invalid_json")


def _too_many(what: str, limit: int) -> InvalidRequest:
    return InvalidRequest(f"request body holds more than {limit} {what}", code="too_many_json_values")


def _nesting(brackets: bytes) -> int | None:
    """Depth of a balanced bracket sequence (``{``/``}`` already mapped to ``[``/``]``) if at most
    ``MAX_JSON_DEPTH``, ``MAX_JSON_DEPTH + 1`` if deeper, None if unbalanced (invalid JSON). Each pass
    removes the innermost level: at most ``MAX_JSON_DEPTH + 1`` C-speed passes."""
    for depth in range(MAX_JSON_DEPTH + 1):
        if not brackets:
            return depth
        inner = brackets.replace(b"[]", b"")
        if len(inner) == len(brackets):
            return None
        brackets = inner
    return MAX_JSON_DEPTH + 1 if brackets else MAX_JSON_DEPTH


def check_json_shape(body: bytes) -> None:
    """Raise ``InvalidRequest`` if ``body`` (JSON text) holds too many values or nests too deep.

    Exact for valid JSON: escaped backslashes and quotes are blanked out, so every remaining ``"``
    delimits a string; the text between strings is the structure. Invalid JSON that passes is left to
    the parser to report."""
    if b'"' in body and b"\\" in body:
        body = body.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    quotes = body.count(b'"')
    if quotes % 2:
        raise _invalid("unterminated string")
    if quotes // 2 > MAX_JSON_STRINGS:
        raise _too_many("strings", MAX_JSON_STRINGS)
    structure = b" ".join(body.split(b'"')[0::2]) if quotes else body
    if structure.count(b",") + 1 > MAX_JSON_VALUES:
        raise _too_many("values", MAX_JSON_VALUES)
    brackets = structure.translate(None, _NOT_BRACKETS)
    if len(brackets) > 2 * MAX_JSON_CONTAINERS:
        raise _too_many("objects and arrays", MAX_JSON_CONTAINERS)
    depth = _nesting(brackets.replace(b"{", b"[").replace(b"}", b"]"))
    if depth is not None and depth > MAX_JSON_DEPTH:
        raise InvalidRequest(
            f"request body is nested more than {MAX_JSON_DEPTH} levels deep", code="invalid_json"
        )


def loads_without_gc(body: bytes) -> Any:
    """``orjson.loads`` with the cyclic collector paused (restored after, even on error)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return orjson.loads(body)
    finally:
        if enabled:
            gc.enable()


async def read_json(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or an ``InvalidRequest`` (400), parsed on the loop: for the admin
    API's small bodies (tenant bodies go through ``gateway.request_body``, large ones off the loop)."""
    return load_json(body)


def load_json(body: bytes) -> dict[str, Any]:
    """``read_json``'s work, for a caller on a thread."""
    check_json_shape(body)
    try:
        data = loads_without_gc(body)
    except orjson.JSONDecodeError as exc:
        raise _invalid(str(exc)) from exc
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_json")
    return data
