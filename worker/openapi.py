"""OpenAPI 3.1 description of the worker API (docs/worker-api.md), served at GET /openapi.json.

Small on purpose: the shapes the gateway sends, so that a fuzzer (tests/security) can exercise every
operation. Every call but /healthz (and this document) needs the shared secret when one is set.
"""

from __future__ import annotations

from typing import Any

_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "code": {"type": ["string", "null"]},
                "param": {"type": ["string", "null"]},
            },
        }
    },
}

_SEGMENT = {
    "type": "object",
    "required": ["start_token", "namespace_id", "key"],
    "properties": {
        "start_token": {"type": "integer", "minimum": 0},
        "namespace_id": {"type": "string", "minLength": 1},
        "key": {"type": "string", "description": "hex, at least 16 bytes"},
        "reserved_blocks": {"type": "integer", "minimum": 0},
    },
}

_SAMPLING = {
    "type": "object",
    "properties": {
        "max_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number"},
        "top_p": {"type": "number"},
        "top_k": {"type": "integer"},
        "seed": {"type": ["integer", "null"]},
        "stop": {"type": "array", "items": {"type": "string"}},
        "stop_token_ids": {"type": "array", "items": {"type": "integer"}},
        "ignore_eos": {"type": "boolean"},
    },
}


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _op(summary: str, body: dict[str, Any] | None = None, *, secured: bool = True) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary,
        "responses": {
            "200": {"description": "OK"},
            "400": {"description": "Bad request", "content": {"application/json": {"schema": _ERROR}}},
            "401": {"description": "Missing or wrong shared secret"},
        },
    }
    if secured:
        op["security"] = [{"sharedSecret": []}]
    if body is not None:
        op["requestBody"] = _body(body)
    return op


def worker_openapi_spec() -> dict[str, Any]:
    generate = {
        "type": "object",
        "required": ["request_id", "prompt_token_ids", "namespace"],
        "properties": {
            "request_id": {"type": "string"},
            "prompt_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "namespace": {"type": "array", "items": _SEGMENT, "minItems": 1},
            "sampling": _SAMPLING,
            "stream": {"type": "boolean"},
            "cache": {"type": "boolean"},
            "x_request_id": {"type": "string"},
            "owner": {
                "type": "string",
                "minLength": 1,
                "description": "the tenant's tag: prefetch lane and budget share (default: last namespace)",
            },
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "prefixgate worker API", "version": "1"},
        "components": {"securitySchemes": {"sharedSecret": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/healthz": {"get": _op("Liveness and the model served", secured=False)},
            "/v1/info": {"get": _op("Model, tokenizer, chat template, block size")},
            "/v1/tokenize": {
                "post": _op(
                    "Text to token ids",
                    {
                        "type": "object",
                        "required": ["text"],
                        "properties": {"text": {"type": "string"}, "add_special_tokens": {"type": "boolean"}},
                    },
                )
            },
            "/v1/detokenize": {
                "post": _op(
                    "Token ids to text",
                    {
                        "type": "object",
                        "required": ["token_ids"],
                        "properties": {"token_ids": {"type": "array", "items": {"type": "integer"}}},
                    },
                )
            },
            "/v1/generate": {"post": _op("Generate (JSON, or NDJSON events when stream)", generate)},
            "/v1/abort": {
                "post": _op(
                    "Abort a request",
                    {
                        "type": "object",
                        "required": ["request_id"],
                        "properties": {"request_id": {"type": "string"}},
                    },
                )
            },
            "/v1/stats": {"get": _op("Tier, pool and scheduler statistics")},
            "/v1/purge": {
                "post": _op(
                    "Erase a namespace from every tier",
                    {
                        "type": "object",
                        "required": ["namespace_id"],
                        "properties": {"namespace_id": {"type": "string", "minLength": 1}},
                    },
                )
            },
            "/metrics": {"get": _op("Prometheus metrics")},
        },
    }
