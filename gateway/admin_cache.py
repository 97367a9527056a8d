"""Admin routes over the cache itself: promoted hot prefixes (list, show, revoke) and tenant purge."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.errors import ConflictError, UpstreamError
from gateway.expect import expect_continue
from gateway.purge import PurgeResult, purge_namespace
from gateway.state import (
    CONFIG,
    HOT_PREFIXES,
    METRICS,
    NEAR_MISS,
    POLICY_CACHE,
    PROMOTION,
    REPOSITORY,
    WORKER_POOL,
)
from policies.isolation import tenant_namespace_id
from tenancy.hot_prefixes import HotPrefixInfo


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


async def purge_namespace_of(
    request: web.Request, tenant_id: str, epoch: int
) -> tuple[PurgeResult, web.Response | None]:
    """Erase a (non-shared) tenant's namespace in every tier of every worker; audit and count it.
    Returns the result and, when a worker did not answer, the 502 response to send."""
    config, repository = request.config_dict[CONFIG], request.config_dict[REPOSITORY]
    namespace_id = tenant_namespace_id(config.salt_bytes, tenant_id)
    result = await purge_namespace(
        request.config_dict[WORKER_POOL], namespace_id, timeout_s=config.purge_timeout_s
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
        return result, None
    error = UpstreamError(
        f"purge incomplete: {len(failed)} of {len(result.workers)} worker(s) did not answer "
        f"({', '.join(failed)}); their copies can no longer be reused (epoch {epoch}); retry the purge",
        code="purge_incomplete",
    )
    body = {"id": tenant_id, "object": "tenant.purge", "epoch": epoch, **result.to_json(), **error.to_json()}
    return result, web.json_response(body, status=error.status)


async def purge_tenant(request: web.Request) -> web.Response:
    """Erase the tenant's KV from every tier of every worker, and bump its epoch.

    The epoch bump makes any copy the purge could not reach (a worker down, a write in flight)
    unreachable by key for good. 200 when every worker answered; 502 with the same body, plus an
    OpenAI-style ``error``, when any did not (retry: purging twice is harmless). 409 for a ``shared``
    tenant, whose KV is not its own to erase.
    """
    tenant_id = request.match_info["tenant_id"]
    repository = request.config_dict[REPOSITORY]
    policy, _ = await repository.get_tenant(tenant_id)  # 404 for an unknown tenant
    if policy.isolation == "shared":
        raise shared_cache_conflict(tenant_id, "; then purge erases what it caches from then on.")
    epoch = await repository.invalidate(tenant_id)
    await request.config_dict[POLICY_CACHE].reload()
    await request.config_dict[NEAR_MISS].forget_tenant(tenant_id, epoch=epoch)  # prompts, vectors, findings
    result, failure = await purge_namespace_of(request, tenant_id, epoch)
    if failure is not None:
        return failure
    return web.json_response({"id": tenant_id, "object": "tenant.purge", "epoch": epoch, **result.to_json()})


def add_routes(admin: web.Application) -> None:
    admin.router.add_get("/hot-prefixes", list_hot_prefixes, expect_handler=expect_continue)
    admin.router.add_get("/hot-prefixes/{hot_prefix_id}", get_hot_prefix, expect_handler=expect_continue)
    admin.router.add_delete(
        "/hot-prefixes/{hot_prefix_id}", revoke_hot_prefix, expect_handler=expect_continue
    )
    admin.router.add_post("/tenants/{tenant_id}/purge", purge_tenant, expect_handler=expect_continue)
