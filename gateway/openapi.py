"""OpenAPI 3.1 description of the tenant and admin APIs (served at GET /openapi.json)."""

from __future__ import annotations

from typing import Any


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERRORS = {
    "400": _json(
        _ref("Error"), "Malformed JSON, wrong types, missing fields, prompt longer than the context"
    ),
    "401": _json(_ref("Error"), "Missing, bad or revoked key"),
    "408": _json(_ref("Error"), "The request body did not arrive within read_timeout_s"),
    "404": _json(_ref("Error"), "Unknown model or object"),
    "413": _json(_ref("Error"), "Body or prompt over the size limit"),
    "415": _json(_ref("Error"), "A Content-Encoding other than identity, gzip or deflate"),
    "417": _json(_ref("Error"), "An Expect other than 100-continue"),
    "429": {
        **_json(_ref("Error"), "Tenant limit: requests or tokens per minute, or requests in flight"),
        "headers": {
            name: {"schema": {"type": "string"}} for name in ("Retry-After", "x-ratelimit-reset-requests")
        },
    },
    "503": {
        **_json(_ref("Error"), "Gateway or workers saturated, no worker ready, worker lost"),
        "headers": {"Retry-After": {"schema": {"type": "string"}}},
    },
}


def _op(
    summary: str,
    *,
    body: str | None = None,
    response: dict[str, Any] | None = None,
    params: list[dict[str, Any]] | None = None,
    security: str = "tenantKey",
) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary,
        "security": [{security: []}],
        "responses": {"200": response or _json({"type": "object"}), **_ERRORS},
    }
    if body:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(body)}}}
    if params:
        op["parameters"] = params
    return op


def _path_param(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}


def _query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema}


_SAMPLING = {
    "model": {"type": "string"},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
    "seed": {"type": "integer"},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0, "description": "extension: 0 disables top-k"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "n": {"type": "integer", "minimum": 1, "maximum": 8},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "logit_bias": {
        "type": "object",
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "description": "token id -> bias added to its logit",
    },
    "user": {"type": "string"},
    "prompt_cache_key": {"type": "string", "description": "routing hint inside the tenant's namespace"},
    "ignore_eos": {"type": "boolean", "description": "extension: generate exactly max_tokens"},
}

_USAGE = {
    "type": "object",
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}},
        "prefixgate": {
            "type": "object",
            "properties": {
                "cached_tokens_by_tier": {"type": "object", "additionalProperties": {"type": "integer"}},
                "prefill_ms": {"type": "number"},
                "estimated_saved_prefill_ms": {"type": "number"},
                "isolation": {"type": "string"},
                "promoted_prefix_tokens": {
                    "type": "integer",
                    "description": "prompt tokens hashed in the global namespace as a promoted hot prefix",
                },
            },
            "additionalProperties": True,
        },
    },
}

_POLICY_PROPS: dict[str, Any] = {
    "name": {"type": "string"},
    "isolation": {"type": "string", "enum": ["shared", "namespace", "dedicated"], "default": "namespace"},
    "reserved_blocks": {"type": "integer", "minimum": 0},
    "canonicalization": {"type": "string", "enum": ["on", "report", "off"], "default": "report"},
    "canonicalization_patterns": {
        "type": "object",
        "additionalProperties": {"type": "string", "maxLength": 256},
        "maxProperties": 16,
        "description": "extra fragment patterns, name -> regular expression (bounded repeats only)",
    },
    "canonicalization_disabled_rules": {
        "type": "array",
        "items": {"type": "string"},
        "description": "built-in fragment rules turned off",
    },
    "canonicalization_note_role": {"type": "string", "enum": ["user", "system", "developer"]},
    "share_hot_prefixes": {"type": "boolean", "default": False},
    "near_miss_routing": {"type": "boolean", "default": False},
    "price_input_per_mtok": {"type": ["number", "null"]},
    "price_cached_input_per_mtok": {"type": ["number", "null"]},
    "price_output_per_mtok": {"type": ["number", "null"]},
    "max_tokens_limit": {"type": ["integer", "null"]},
    "rate_limit_rpm": {"type": ["integer", "null"]},
    "rate_limit_tpm": {"type": ["integer", "null"], "description": "prompt + max_tokens per minute"},
    "max_concurrent_requests": {"type": ["integer", "null"], "description": "in flight, per replica"},
}


def openapi_spec() -> dict[str, Any]:
    tid = _path_param("tenant_id")
    schemas = {
        "Error": {
            "type": "object",
            "properties": {
                "error": {
                    "type": "object",
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": {"type": ["string", "null"]},
                        "code": {"type": ["string", "null"]},
                    },
                }
            },
        },
        "ChatCompletionRequest": {
            "type": "object",
            "required": ["model", "messages"],
            "properties": {
                **_SAMPLING,
                "max_completion_tokens": {"type": "integer", "minimum": 1},
                "messages": {"type": "array", "minItems": 1, "items": {"type": "object"}},
                "tools": {
                    "type": "array",
                    "items": {"type": "object"},
                    "description": "rendered into the prompt; calls in the answer parsed into tool_calls",
                },
                "tool_choice": {
                    "oneOf": [
                        {"type": "string", "enum": ["auto", "none", "required"]},
                        {
                            "type": "object",
                            "description": "a named function, enforced by constrained decoding",
                        },
                    ]
                },
                "response_format": {
                    "type": "object",
                    "description": "text, json_object or json_schema (enforced by constrained decoding)",
                },
                "logprobs": {"type": "boolean"},
                "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
            },
        },
        "CompletionRequest": {
            "type": "object",
            "required": ["model", "prompt"],
            "properties": {
                **_SAMPLING,
                "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]},
                "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
            },
        },
        "Usage": _USAGE,
        "TenantPolicy": {"type": "object", "properties": _POLICY_PROPS},
        "TenantCreate": {"type": "object", "required": ["name"], "properties": _POLICY_PROPS},
    }
    admin = "adminToken"
    paths = {
        "/v1/chat/completions": {
            "post": _op("Chat completion (JSON or SSE stream)", body="ChatCompletionRequest")
        },
        "/v1/completions": {"post": _op("Text completion (JSON or SSE stream)", body="CompletionRequest")},
        "/v1/prompt-lint": {
            "post": _op(
                "What canonicalization would change in a chat request and the reuse it costs",
                body="ChatCompletionRequest",
            )
        },
        "/v1/models": {"get": _op("Models served by the workers")},
        "/v1/models/{model}": {"get": _op("One model", params=[_path_param("model")])},
        "/healthz": {
            "get": {
                "summary": "Readiness (503 until a worker and the policies are up)",
                "responses": {"200": _json({"type": "object"})},
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics (PREFIXGATE_METRICS_TOKEN or the admin token)",
                "security": [{admin: []}],
                "responses": {"200": {"description": "text"}, "401": _ERRORS["401"]},
            }
        },
        "/admin/v1/tenants": {
            "post": _op("Create a tenant; the API key is returned once", body="TenantCreate", security=admin),
            "get": _op("List tenants", security=admin),
        },
        "/admin/v1/tenants/{tenant_id}": {
            "get": _op("Get a tenant", params=[tid], security=admin),
            "patch": _op("Update policy fields", params=[tid], body="TenantPolicy", security=admin),
            "delete": _op("Delete a tenant (usage records are kept)", params=[tid], security=admin),
        },
        "/admin/v1/tenants/{tenant_id}/invalidate": {
            "post": _op(
                "Bump the tenant epoch: its next request reuses nothing", params=[tid], security=admin
            )
        },
        "/admin/v1/tenants/{tenant_id}/purge": {
            "post": _op(
                "Erase the tenant's cached KV from every tier of every worker (and bump its epoch); "
                "502 with per-worker results when a worker did not answer",
                params=[tid],
                security=admin,
            )
        },
        "/admin/v1/tenants/{tenant_id}/near-miss": {
            "get": _op(
                "Where the tenant's similar prompts diverged (near-miss routing, this replica): "
                "candidate canonicalization rules",
                params=[tid],
                security=admin,
            )
        },
        "/admin/v1/namespace-secret": {
            "get": _op(
                "Epoch of the deployment's namespace secret in force, and the one this replica uses",
                security=admin,
            )
        },
        "/admin/v1/namespace-secret/rotate": {
            "post": _op(
                "New namespace secret under the next epoch (invalidates every cached block once the "
                "replicas restart); 409 when the secret is configured",
                security=admin,
            )
        },
        "/admin/v1/hot-prefixes": {
            "get": _op(
                "Promoted hot prefixes (hash, tokens, hits, tenant count; never tenants or text)",
                security=admin,
                params=[_query("include_revoked", {"type": "boolean"})],
            )
        },
        "/admin/v1/hot-prefixes/{hot_prefix_id}": {
            "get": _op("One promotion, with its text", params=[_path_param("hot_prefix_id")], security=admin),
            "delete": _op("Revoke a promotion", params=[_path_param("hot_prefix_id")], security=admin),
        },
        "/admin/v1/tenants/{tenant_id}/keys": {
            "get": _op("List keys (metadata only)", params=[tid], security=admin),
            "post": _op("Add a key (returned once)", params=[tid], security=admin),
        },
        "/admin/v1/tenants/{tenant_id}/keys/rotate": {
            "post": _op("New key; every other key is revoked", params=[tid], security=admin)
        },
        "/admin/v1/tenants/{tenant_id}/keys/{key_id}/revoke": {
            "post": _op("Revoke a key", params=[tid, _path_param("key_id")], security=admin)
        },
        "/admin/v1/audit": {
            "get": _op(
                "Audit log of admin changes",
                security=admin,
                params=[_query("tenant_id", {"type": "string"}), _query("limit", {"type": "integer"})],
            )
        },
        "/admin/v1/reports/usage": {
            "get": _op(
                "Usage and hit-rate report, paged with a cursor (totals of the whole report)",
                security=admin,
                params=[
                    _query("tenant_id", {"type": "string"}),
                    _query("start", {"type": "string", "format": "date-time"}),
                    _query("end", {"type": "string", "format": "date-time"}),
                    _query("granularity", {"type": "string", "enum": ["hour", "day"]}),
                    _query("group_by", {"type": "string", "enum": ["key", "end_user"]}),
                    _query("cursor", {"type": "string"}),
                    _query("limit", {"type": "integer", "minimum": 1, "maximum": 10000}),
                    _query("format", {"type": "string", "enum": ["json", "csv"]}),
                ],
            )
        },
        "/admin/v1/reports/requests": {
            "get": _op(
                "Per-request usage export, paged with a cursor",
                security=admin,
                params=[
                    _query("tenant_id", {"type": "string"}),
                    _query("start", {"type": "string", "format": "date-time"}),
                    _query("end", {"type": "string", "format": "date-time"}),
                    _query("cursor", {"type": "string"}),
                    _query("limit", {"type": "integer", "minimum": 1, "maximum": 10000}),
                    _query("format", {"type": "string", "enum": ["json", "csv"]}),
                ],
            )
        },
        "/admin/v1/usage/rejected": {
            "get": _op(
                "Usage records the database refused",
                security=admin,
                params=[_query("limit", {"type": "integer"})],
            )
        },
        "/admin/v1/usage/rejected/retry": {"post": _op("Retry the rejected usage records", security=admin)},
        "/admin/v1/workers": {"get": _op("Worker pool health", security=admin)},
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "prefixgate",
            "version": "0.1.0",
            "description": "Multi-tenant, OpenAI-compatible prefix-caching LLM gateway",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "tenantKey": {"type": "http", "scheme": "bearer", "description": "tenant API key"},
                "adminToken": {"type": "http", "scheme": "bearer", "description": "PREFIXGATE_ADMIN_TOKEN"},
            },
        },
    }
