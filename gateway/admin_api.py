"""Admin API under /admin/v1/ (a sub-application with its own bearer-token middleware)."""

from __future__ import annotations

import asyncio
import re
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from gateway import admin_cache, admin_reports
from gateway.errors import (
    AuthenticationError,
    ConflictError,
    InvalidRequest,
    NotFoundError,
    PermissionDenied,
)
from gateway.expect import expect_continue, is_unrouted, route_everything
from gateway.namespace_secret import namespace_secret_status, rotate_namespace_secret
from gateway.schemas import read_json
from gateway.slow_clients import request_body
from gateway.state import CONFIG, NEAR_MISS, POLICY_CACHE, REPOSITORY, WORKER_POOL
from gateway.tenant_calls import bearer_token
from policies.isolation import tenant_namespace_id
from tenancy.keys import tokens_equal
from tenancy.policy import PolicyError, TenantPolicy
from tenancy.repository import Conflict, KeyInfo, NewKey, NotFound


def check_admin_token(request: web.Request) -> None:
    """Raises unless the request bears the admin token (403 when the admin API is disabled)."""
    expected = request.config_dict[CONFIG].admin_token
    if not expected:
        raise PermissionDenied("the admin API is disabled: set PREFIXGATE_ADMIN_TOKEN")
    given = bearer_token(request)
    if given is None or not tokens_equal(given, expected):
        raise AuthenticationError("invalid admin token", code="invalid_admin_token")


@web.middleware
async def admin_auth_middleware(request: web.Request, handler):  # type: ignore[no-untyped-def]
    check_admin_token(request)
    _check_path_and_query(request)
    try:
        return await handler(request)
    except PolicyError as exc:
        raise InvalidRequest(str(exc), param=exc.param, code="invalid_value") from exc
    except NotFound as exc:
        raise NotFoundError(str(exc), code="not_found") from exc
    except Conflict as exc:
        raise ConflictError(str(exc), code="conflict") from exc


_ID = re.compile(r"[A-Za-z0-9_.\-]{1,40}")  # every id of ours ("tn_…", "key_…", "hp_…") fits a String(40)
_CONTROL = re.compile("[\x00-\x1f\x7f]")


def _check_path_and_query(request: web.Request) -> None:
    """Malformed ids are unknown ids (404) and control characters in a query value a 400, before any
    database sees them (PostgreSQL refuses NUL in text: that was a 500). A path no route takes holds
    no id (the catch-all's ``tail`` is not one): it is answered "no route", as everywhere else (r22)."""
    for name, value in () if is_unrouted(request) else request.match_info.items():
        if not _ID.fullmatch(value):
            raise NotFoundError(
                f"no {name.removesuffix('_id').replace('_', ' ')} with that id", code="not_found"
            )
    for name, value in request.query.items():
        if _CONTROL.search(name) or _CONTROL.search(value):
            raise InvalidRequest("query values must not contain control characters", param=name)


def _no_nul(value: Any, where: str) -> None:
    """A NUL anywhere in an admin body's strings (keys included) is a 400: no text column stores it."""
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                raise InvalidRequest(
                    f"'{path}' must not contain NUL characters", param=path, code="invalid_value"
                )
        elif isinstance(item, dict):
            for key, child in item.items():
                stack += [(key, path), (child, f"{path}.{key}" if path else str(key))]
        elif isinstance(item, list):
            stack += [(child, path) for child in item]


async def _admin_body(request: web.Request) -> dict[str, Any]:
    body = await read_json(await request_body(request))
    _no_nul(body, "")
    return body


def _iso(moment: datetime | None) -> str | None:
    if moment is None:
        return None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).isoformat()


def _tenant_json(
    request: web.Request, policy: TenantPolicy, created_at: datetime | None = None
) -> dict[str, Any]:
    salt = request.config_dict[CONFIG].salt_bytes
    body = {"id": policy.tenant_id, "object": "tenant", **asdict(policy)}
    del body["tenant_id"]
    body["canonicalization_patterns"] = dict(policy.canonicalization_patterns)
    body["canonicalization_disabled_rules"] = list(policy.canonicalization_disabled_rules)
    body["namespace_id"] = tenant_namespace_id(salt, policy.tenant_id)
    if created_at is not None:
        body["created_at"] = _iso(created_at)
    return body


def _key_json(info: KeyInfo) -> dict[str, Any]:
    return {
        "id": info.id,
        "object": "api_key",
        "tenant_id": info.tenant_id,
        "key_prefix": info.key_prefix,
        "created_at": _iso(info.created_at),
        "revoked_at": _iso(info.revoked_at),
        "revoked": info.revoked_at is not None,
    }


def _new_key_json(new_key: NewKey) -> dict[str, Any]:
    return {**_key_json(new_key.info), "api_key": new_key.api_key}


async def _changed(request: web.Request) -> None:
    """Apply an admin change on this replica at once (others pick it up within policy_refresh_s)."""
    await request.config_dict[POLICY_CACHE].reload()


async def create_tenant(request: web.Request) -> web.Response:
    body = await _admin_body(request)
    policy, new_key = await request.config_dict[REPOSITORY].create_tenant(body)
    await _changed(request)
    tenant = _tenant_json(request, policy)
    return web.json_response({**tenant, "api_key": new_key.api_key, "key_id": new_key.info.id}, status=201)


async def list_tenants(request: web.Request) -> web.Response:
    tenants = await request.config_dict[REPOSITORY].list_tenants()
    return web.json_response({"object": "list", "data": [_tenant_json(request, p, at) for p, at in tenants]})


async def get_tenant(request: web.Request) -> web.Response:
    policy, created_at = await request.config_dict[REPOSITORY].get_tenant(request.match_info["tenant_id"])
    return web.json_response(_tenant_json(request, policy, created_at))


async def near_miss_findings(request: web.Request) -> web.Response:
    """Where this tenant's similar prompts diverged (recent near misses, every replica's when they share
    Redis): candidate canonicalization rules."""
    policy, _ = await request.config_dict[REPOSITORY].get_tenant(request.match_info["tenant_id"])
    findings = await request.config_dict[NEAR_MISS].findings(policy.tenant_id)
    return web.json_response({"object": "list", "tenant_id": policy.tenant_id, "data": findings})


async def update_tenant(request: web.Request) -> web.Response:
    body = await _admin_body(request)
    policy = await request.config_dict[REPOSITORY].update_tenant(request.match_info["tenant_id"], body)
    await _changed(request)
    return web.json_response(_tenant_json(request, policy))


async def delete_tenant(request: web.Request) -> web.Response:
    """Purge first, then delete: a tenant is gone only once its KV is gone from every tier of every
    worker (502 and still there when a worker did not answer; retry). A ``shared`` tenant's share of the
    common pool is not attributable to it: 409 unless ``?shared_cache=keep`` says the admin knows it
    stays; its own namespaces (what it cached before it was moved to ``shared``) are purged all the same."""
    tenant_id = request.match_info["tenant_id"]
    repository = request.config_dict[REPOSITORY]
    policy, _ = await repository.get_tenant(tenant_id)  # 404 for an unknown tenant
    if policy.isolation == "shared" and request.query.get("shared_cache") != "keep":
        raise admin_cache.shared_cache_conflict(tenant_id, "; or delete with ?shared_cache=keep.")
    await admin_cache.fence_tenant(request, tenant_id)  # no replica serves or caches for it any more
    _, result, failure = await admin_cache.erase_tenant_cache(request, tenant_id)
    if failure is not None:
        return failure
    await repository.delete_tenant(tenant_id)
    await _changed(request)
    return web.json_response(
        {"id": tenant_id, "object": "tenant", "deleted": True, "purge": result.to_json()}
    )


async def invalidate_tenant(request: web.Request) -> web.Response:
    tenant_id = request.match_info["tenant_id"]
    repository = request.config_dict[REPOSITORY]
    policy, _ = await repository.get_tenant(tenant_id)
    if policy.isolation == "shared":  # its key is the global one: an epoch bump would change nothing
        raise admin_cache.shared_cache_conflict(tenant_id, ".")
    epoch = await repository.invalidate(tenant_id)
    await _changed(request)
    await request.config_dict[NEAR_MISS].forget_tenant(tenant_id, epoch=epoch)  # prompts, vectors, findings
    return web.json_response({"id": tenant_id, "object": "tenant", "epoch": epoch, "invalidated": True})


async def list_keys(request: web.Request) -> web.Response:
    keys = await request.config_dict[REPOSITORY].list_keys(request.match_info["tenant_id"])
    return web.json_response({"object": "list", "data": [_key_json(key) for key in keys]})


async def create_key(request: web.Request) -> web.Response:
    new_key = await request.config_dict[REPOSITORY].create_key(
        request.match_info["tenant_id"], revoke_others=False
    )
    await _changed(request)
    return web.json_response(_new_key_json(new_key), status=201)


async def rotate_key(request: web.Request) -> web.Response:
    new_key = await request.config_dict[REPOSITORY].create_key(
        request.match_info["tenant_id"], revoke_others=True
    )
    await _changed(request)
    return web.json_response(_new_key_json(new_key), status=201)


async def revoke_key(request: web.Request) -> web.Response:
    info = await request.config_dict[REPOSITORY].revoke_key(
        request.match_info["tenant_id"], request.match_info["key_id"]
    )
    await _changed(request)
    return web.json_response(_key_json(info))


async def audit_log(request: web.Request) -> web.Response:
    limit = admin_reports.query_limit(request, 100, 10_000)
    rows = await request.config_dict[REPOSITORY].audit_log(
        tenant_id=request.query.get("tenant_id"), limit=limit
    )
    data = [
        {
            "id": row.id,
            "at": _iso(row.at),
            "actor": row.actor,
            "action": row.action,
            "tenant_id": row.tenant_id,
            "details": row.details,
        }
        for row in rows
    ]
    return web.json_response({"object": "list", "data": data})


async def workers_status(request: web.Request) -> web.Response:
    """Each worker's health as the gateway sees it, plus its live ``/v1/stats`` (null if unreachable)."""
    pool = request.config_dict[WORKER_POOL]

    async def stats(url: str) -> dict[str, Any] | None:
        try:
            return await pool.client(url).stats()
        except Exception:
            return None

    rows = pool.status()
    live = await asyncio.gather(*(stats(row["url"]) for row in rows))
    data = [{**row, "stats": worker_stats} for row, worker_stats in zip(rows, live, strict=True)]
    return web.json_response({"object": "list", "data": data})


def create_admin_app() -> web.Application:
    admin = web.Application(middlewares=[admin_auth_middleware])
    r = admin.router
    r.add_post("/tenants", create_tenant, expect_handler=expect_continue)
    r.add_get("/tenants", list_tenants, expect_handler=expect_continue)
    r.add_get("/tenants/{tenant_id}", get_tenant, expect_handler=expect_continue)
    r.add_patch("/tenants/{tenant_id}", update_tenant, expect_handler=expect_continue)
    r.add_delete("/tenants/{tenant_id}", delete_tenant, expect_handler=expect_continue)
    r.add_post("/tenants/{tenant_id}/invalidate", invalidate_tenant, expect_handler=expect_continue)
    r.add_get("/tenants/{tenant_id}/near-miss", near_miss_findings, expect_handler=expect_continue)
    r.add_get("/namespace-secret", namespace_secret_status, expect_handler=expect_continue)
    r.add_post("/namespace-secret/rotate", rotate_namespace_secret, expect_handler=expect_continue)
    r.add_get("/tenants/{tenant_id}/keys", list_keys, expect_handler=expect_continue)
    r.add_post("/tenants/{tenant_id}/keys", create_key, expect_handler=expect_continue)
    r.add_post("/tenants/{tenant_id}/keys/rotate", rotate_key, expect_handler=expect_continue)
    r.add_post("/tenants/{tenant_id}/keys/{key_id}/revoke", revoke_key, expect_handler=expect_continue)
    r.add_delete("/tenants/{tenant_id}/keys/{key_id}", revoke_key, expect_handler=expect_continue)
    r.add_get("/audit", audit_log, expect_handler=expect_continue)
    r.add_get("/workers", workers_status, expect_handler=expect_continue)
    admin_cache.add_routes(admin)
    admin_reports.add_routes(admin)
    route_everything(admin, sub_app=True)
    return admin
