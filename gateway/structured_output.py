"""``response_format`` as a grammar for the worker's constrained decoding (worker/structured.py).

Parsing (``response_format_grammar``) checks the shape only; ``check_grammar`` then compiles the schema
with llguidance (no tokenizer needed, no torch; it drops the GIL, and the handler runs it in a thread so
that a large schema never stalls other tenants' requests), so a schema the worker could not compile is a
400 naming ``response_format`` before any routing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import llguidance
import orjson

from gateway.errors import InvalidRequest

MAX_SCHEMA_BYTES = 256 << 10
SCHEMA_PARAM = "response_format.json_schema.schema"


def _invalid(message: str, param: str = "response_format") -> InvalidRequest:
    return InvalidRequest(message, param=param, code="invalid_value")


def check_schema_shape(schema: Any, param: str) -> None:
    """Cheap checks: an object, serializable, not too large."""
    if not isinstance(schema, dict):
        raise _invalid(f"'{param}' must be a JSON schema object", param)
    try:
        size = len(orjson.dumps(schema))
    except TypeError as exc:  # integers beyond 64 bits
        raise _invalid(f"'{param}' is not a usable JSON schema: {exc}", param) from None
    if size > MAX_SCHEMA_BYTES:
        raise _invalid(f"'{param}' is larger than {MAX_SCHEMA_BYTES} bytes", param)


def check_json_schema(schema: Any, param: str) -> None:
    """Raise a 400 naming ``param`` unless llguidance compiles ``schema`` (up to ~0.1 s: off the loop)."""
    check_schema_shape(schema, param)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except ValueError as exc:
        raise _invalid(f"'{param}' is not a usable JSON schema: {exc}", param) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise _invalid(f"'{param}' is not a usable JSON schema: {error}", param)


def response_format_grammar(value: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The worker grammar of a ``response_format`` (None: free text)."""
    if value is None or value.get("type") == "text":
        return None
    kind = value.get("type")
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise _invalid("'response_format.type' must be 'text', 'json_object' or 'json_schema'")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise _invalid(
            "'response_format.json_schema' must be an object with a 'name'", "response_format.json_schema"
        )
    schema = spec.get("schema")
    if schema is None:  # OpenAI allows a schema-less json_schema: any JSON object
        return {"type": "json_object"}
    check_schema_shape(schema, SCHEMA_PARAM)
    return {"type": "json_schema", "schema": schema}


def check_grammar(grammar: Mapping[str, Any] | None) -> None:
    """Compile a ``response_format`` grammar's schema (see ``check_json_schema``)."""
    if grammar is not None and grammar.get("type") == "json_schema":
        check_json_schema(grammar["schema"], SCHEMA_PARAM)
