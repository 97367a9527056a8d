"""``response_format`` as a grammar for the worker's constrained decoding (worker/structured.py).

Parsing (``response_format_grammar``) checks the shape only; ``check_grammar`` then compiles the schema
with llguidance (no tokenizer needed, no torch; it drops the GIL, and the handler runs it in a thread so
that a large schema never stalls other tenants' requests), so a schema the worker could not compile is a
400 naming ``response_format`` before any routing.

``strict: true`` (on ``response_format.json_schema`` or ``tools[].function``) is OpenAI's strict mode: the
answer has every property of every object and no other. Constrained decoding already fits the schema,
so strict adds nothing to enforce; instead a schema that does not say so itself is refused, as OpenAI
refuses it (``check_strict_schema``): the root is an object, and every object lists all its properties in
``required`` and sets ``additionalProperties: false``. A ``strict`` that is not a boolean is a 400.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    strict = _strict_flag(spec, "response_format.json_schema.strict")
    schema = spec.get("schema")
    if schema is None:  # OpenAI allows a schema-less json_schema: any JSON object
        return {"type": "json_object"}
    check_schema_shape(schema, SCHEMA_PARAM)
    if strict:
        check_strict_schema(schema, SCHEMA_PARAM)
    return {"type": "json_schema", "schema": schema}


def check_grammar(grammar: Mapping[str, Any] | None) -> None:
    """Compile a ``response_format`` grammar's schema (see ``check_json_schema``)."""
    if grammar is not None and grammar.get("type") == "json_schema":
        check_json_schema(grammar["schema"], SCHEMA_PARAM)


def check_strict_tools(tools: Sequence[Any]) -> None:
    """``tools[i].function.strict``: a boolean; when true, the parameters obey ``check_strict_schema``."""
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping):
            continue  # gateway.tool_calls refuses a tool that is not a function
        if _strict_flag(function, f"tools[{index}].function.strict"):
            param = f"tools[{index}].function.parameters"
            parameters = function.get("parameters")
            check_schema_shape(parameters, param)
            check_strict_schema(parameters, param)


def check_strict_schema(schema: Mapping[str, Any], param: str) -> None:
    """Refuse (400 naming ``param``) a schema OpenAI's strict mode refuses: a root that is not an object,
    or an object anywhere (properties, items, anyOf…, $defs) without every property in ``required`` or
    without ``additionalProperties: false``."""
    kind = schema.get("type", "object" if "$ref" in schema else None)
    if kind != "object" or "anyOf" in schema:
        raise _invalid(f"'{param}' must be an object schema (not anyOf) when 'strict' is true", param)
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, list):
            stack += [(item, f"{where}/{i}") for i, item in enumerate(node)]
            continue
        if not isinstance(node, Mapping):
            continue
        _check_strict_object(node, where or "/", param)
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), Mapping):
                stack += [(sub, f"{where}/{key}/{name}") for name, sub in node[key].items()]
        stack += [(node[key], f"{where}/{key}") for key in _SUBSCHEMAS if key in node]


_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMAS = ("items", "prefixItems", "anyOf", "oneOf", "allOf", "not")


def _check_strict_object(node: Mapping[str, Any], where: str, param: str) -> None:
    kind = node.get("type")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind) and "properties" not in node:
        return
    if node.get("additionalProperties") is not False:
        raise _invalid(
            f"'{param}': the object at {where} must set 'additionalProperties': false when 'strict' is true",
            param,
        )
    properties = node.get("properties") or {}
    required = node.get("required") or []
    if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
        raise _invalid(
            f"'{param}': 'required' of the object at {where} must be a list of property names", param
        )
    missing = sorted(set(properties) - set(required)) if isinstance(properties, Mapping) else []
    if missing:
        raise _invalid(
            f"'{param}': the object at {where} must list every property in 'required' when 'strict' is "
            f"true (missing: {', '.join(missing)}; make an optional one nullable instead)",
            param,
        )


def _strict_flag(spec: Mapping[str, Any], param: str) -> bool:
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _invalid(f"'{param}' must be a boolean", param)
    return bool(strict)
