"""Admin routes over the cache itself: promoted hot prefixes (list, show, revoke) and tenant purge."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from gateway.errors import ConflictError, UpstreamError
from gateway.expect import expect_continue
from gateway.purge import PurgeResult, purge_namespaces
from gateway.state import (
    CONFIG,
    HOT_PREFIXES,
    METRICS,
    NEAR_MISS,
    POLICY_CACHE,
    PROMOTION,
    REPOSITORY,
    SESSIONMAKER,
    WORKER_POOL,
)
from policies.isolation import tenant_namespace_id
from tenancy.hot_prefixes import HotPrefixInfo
from tenancy.namespace_secret import NamespaceSecretRepository


def _hot_prefix_json(info: HotPrefixInfo) -> dict[str, Any]:
    """Hash, size and counts at promotion: never which tenants, never the text."""
    return {
        "id": info.id,
        "object": "hot_prefix",
        "prefix_hash": info.prefix_hash,
        "model": info.model,
        "num_tokens": info.num_tokens,
        "hits_per_hour": info.hits_per_hour,
        "num_tenants": info.num_tenants,
        "promoted_at": info.promoted_at.isoformat(),
        "revoked_at": info.revoked_at.isoformat() if info.revoked_at else None,
        "revoked": info.revoked_at is not None,
    }


async def list_hot_prefixes(request: web.Request) -> web.Response:
    include_revoked = request.query.get("include_revoked", "").lower() in {"1", "true", "yes"}
    rows = await request.config_dict[HOT_PREFIXES].list(include_revoked=include_revoked)
    return web.json_response({"object": "list", "data": [_hot_prefix_json(row) for row in rows]})


async def get_hot_prefix(request: web.Request) -> web.Response:
    """One promotion with its text (when the gateway stores texts): asked for by id only."""
    info, text = await request.config_dict[HOT_PREFIXES].get(request.match_info["hot_prefix_id"])
    return web.json_response({**_hot_prefix_json(info), "text": text})


async def revoke_hot_prefix(request: web.Request) -> web.Response:
    """Revoke: opted-in tenants hash the prefix in their own namespaces again from the next request."""
    info = await request.config_dict[HOT_PREFIXES].revoke(request.match_info["hot_prefix_id"])
    await request.config_dict[POLICY_CACHE].reload()
    await request.config_dict[PROMOTION].forget(info.prefix_hash)
    return web.json_response(_hot_prefix_json(info))


SHARED_CACHE_MESSAGE = (
    "tenant {tenant_id!r} is 'shared': its KV lives in the common pool under the global namespace, "
    "mixed with every other shared tenant's and not attributable to it, so it cannot be erased or "
    "invalidated on its own. Move the tenant to 'namespace' isolation first (later requests are then "
    "private and purgeable){extra}"
)


def shared_cache_conflict(tenant_id: str, extra: str = "") -> ConflictError:
    return ConflictError(SHARED_CACHE_MESSAGE.format(tenant_id=tenant_id, extra=extra), code="shared_cache")


async def tenant_namespace_ids(request: web.Request, tenant_id: str) -> list[str]:
    """Every namespace id the tenant had: under the secret in use here, then under each secret still on
    record in ``namespace_secrets`` (a rotation changes the id; blocks cached under the old one stay)."""
    on_record = await NamespaceSecretRepository(request.config_dict[SESSIONMAKER]).all_epochs()
    salts = [request.config_dict[CONFIG].salt_bytes, *(row.secret.encode() for row in on_record)]
    return list(dict.fromkeys(tenant_namespace_id(salt, tenant_id) for salt in salts))


async def fence_tenant(request: web.Request, tenant_id: str) -> None:
    """Before a delete's purge: revoke the tenant's keys (this replica refuses it at once, every other one
    from its next policy poll), then wait ``delete_fence_s`` for those polls, so that the purge also
    reaches what another replica cached for the tenant until then (review r22). The wait is bounded
    (``delete_fence_max_s``): a replica polling less often than that may still cache after the purge."""
    config = request.config_dict[CONFIG]
    await request.config_dict[REPOSITORY].fence_tenant(tenant_id)
    await request.config_dict[POLICY_CACHE].reload()
    await asyncio.sleep(config.delete_fence_s)


async def erase_tenant_cache(
    request: web.Request, tenant_id: str
) -> tuple[int, PurgeResult, web.Response | None]:
    """Bump the tenant's epoch, drop its near-miss state, and erase every namespace id it ever had (whatever
    its isolation level now: a tenant moved to ``shared`` keeps what it cached before in its own
    namespace) in every tier of every worker, which also ends any worker reservation on those ids. The
    common pool is never touched. Returns the epoch, the result and, when a worker did not answer, the
    502 response to send (retry: purging twice is harmless)."""
    config, repository = request.config_dict[CONFIG], request.config_dict[REPOSITORY]
    epoch = await repository.invalidate(tenant_id)  # nothing cached from now on is reusable
    await request.config_dict[POLICY_CACHE].reload()
    await request.config_dict[NEAR_MISS].forget_tenant(tenant_id, epoch=epoch)  # prompts, vectors, findings
    namespace_ids = await tenant_namespace_ids(request, tenant_id)
    result = await purge_namespaces(
        request.config_dict[WORKER_POOL], namespace_ids, timeout_s=config.purge_timeout_s
    )
    failed = [worker.url for worker in result.workers if worker.error is not None]
    await repository.record_purge(
        tenant_id, {"blocks_erased": result.blocks_erased, "workers_failed": failed, "epoch": epoch}
    )
    metrics = request.config_dict[METRICS]
    metrics.purges.labels("complete" if result.complete else "partial").inc()
    for tier, count in result.blocks_erased.items():
        metrics.purged_blocks.labels(tier).inc(count)
    if result.complete:
        return epoch, result, None
    error = UpstreamError(
        f"purge incomplete: {len(failed)} of {len(result.workers)} worker(s) did not answer "
        f"({', '.join(failed)}); their copies can no longer be reused (epoch {epoch}); retry the purge",
        code="purge_incomplete",
    )
    body = {"id": tenant_id, "object": "tenant.purge", "epoch": epoch, **result.to_json(), **error.to_json()}
    return epoch, result, web.json_response(body, status=error.status)


async def purge_tenant(request: web.Request) -> web.Response:
    """Erase the tenant's KV from every tier of every worker, and bump its epoch.

    The epoch bump makes any copy the purge could not reach (a worker down, a write in flight)
    unreachable by key for good. 200 when every worker answered; 502 with the same body, plus an
    OpenAI-style ``error``, when any did not (retry: purging twice is harmless). For a ``shared`` tenant
    this erases what it cached in its own namespace before it was moved to ``shared``; what it put in
    the common pool is not its own to erase (``shared_pool_erased`` false says so).
    """
    tenant_id = request.match_info["tenant_id"]
    policy, _ = await request.config_dict[REPOSITORY].get_tenant(tenant_id)  # 404 for an unknown tenant
    epoch, result, failure = await erase_tenant_cache(request, tenant_id)
    if failure is not None:
        return failure
    body = {"id": tenant_id, "object": "tenant.purge", "epoch": epoch, **result.to_json()}
    if policy.isolation == "shared":
        body["shared_pool_erased"] = False
    return web.json_response(body)


def add_routes(admin: web.Application) -> None:
    admin.router.add_get("/hot-prefixes", list_hot_prefixes, expect_handler=expect_continue)
    admin.router.add_get("/hot-prefixes/{hot_prefix_id}", get_hot_prefix, expect_handler=expect_continue)
    admin.router.add_delete(
        "/hot-prefixes/{hot_prefix_id}", revoke_hot_prefix, expect_handler=expect_continue
    )
    admin.router.add_post("/tenants/{tenant_id}/purge", purge_tenant, expect_handler=expect_continue)
