"""The gateway's aiohttp application factory; resources live in ``cleanup_ctx``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from gateway import openai_api, request_id
from gateway.admin_api import create_admin_app
from gateway.canonicalization import CanonicalizationStep
from gateway.config import GatewayConfig
from gateway.errors import error_middleware
from gateway.metrics import GatewayMetrics
from gateway.openapi import openapi_spec
from gateway.parameters import UnknownFields
from gateway.pipeline import RequestPipeline
from gateway.promotion import HotPrefixPromotion
from gateway.promotion_redis import RedisPromotionCounter
from gateway.ratelimit import LocalRateLimiter, RedisRateLimiter
from gateway.routing import ROUTERS
from gateway.state import (
    CANONICALIZER,
    CONFIG,
    ENGINE,
    HOT_PREFIXES,
    HTTP_SESSION,
    METRICS,
    PIPELINE,
    POLICY_CACHE,
    PROMOTION,
    RATE_LIMITER,
    REPOSITORY,
    SESSIONMAKER,
    UNKNOWN_FIELDS,
    USAGE_WRITER,
    WORKER_POOL,
)
from gateway.workers import WorkerPool
from policies.promotion import InMemoryPromotionCounter, PromotionCounter, PromotionPolicy
from tenancy.cache import PolicyCache
from tenancy.db import create_engine, create_sessionmaker
from tenancy.hot_prefixes import HotPrefixRepository
from tenancy.repository import TenantRepository
from tenancy.spool import UsageSpool
from tenancy.usage import UsageWriter

log = logging.getLogger(__name__)


async def _stop(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def rate_limit_ctx(app: web.Application) -> AsyncIterator[None]:
    redis_url = app[CONFIG].redis_url
    app[RATE_LIMITER] = RedisRateLimiter(redis_url) if redis_url else LocalRateLimiter()
    yield
    await app[RATE_LIMITER].close()


async def database_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    engine = create_engine(config.resolved_database_url)
    sessionmaker = create_sessionmaker(engine)
    repository = TenantRepository(sessionmaker)
    cache = PolicyCache(repository, refresh_s=config.policy_refresh_s)
    app[ENGINE], app[SESSIONMAKER], app[REPOSITORY], app[POLICY_CACHE] = (
        engine,
        sessionmaker,
        repository,
        cache,
    )
    app[HOT_PREFIXES] = HotPrefixRepository(sessionmaker)
    try:
        await cache.reload()
    except Exception as exc:  # serve 503 for tenant calls until the database answers
        log.warning("could not load tenant policies yet: %s", exc)
    refresher = asyncio.create_task(cache.run(), name="policy-refresh")
    yield
    await _stop(refresher)
    await engine.dispose()


async def usage_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    writer = UsageWriter(
        app[SESSIONMAKER],
        UsageSpool(config.resolved_spool_path),
        flush_s=config.usage_flush_s,
        batch_max=config.usage_batch_max,
    )
    app[USAGE_WRITER] = writer
    task = asyncio.create_task(writer.run(), name="usage-writer")
    yield
    await _stop(task)
    await writer.close()


async def promotion_ctx(app: web.Application) -> AsyncIterator[None]:
    """Hot-prefix counters: in this process, or in Redis (shared by replicas) when redis_url is set."""
    config = app[CONFIG]
    redis_counter = (
        RedisPromotionCounter(config.redis_url, salt=config.salt_bytes) if config.redis_url else None
    )
    counter: PromotionCounter = redis_counter or InMemoryPromotionCounter()
    app[PROMOTION] = HotPrefixPromotion(
        counter=counter,
        policy=PromotionPolicy(
            min_hits_per_hour=config.promotion_min_hits, min_tenants=config.promotion_min_tenants
        ),
        cache=app[POLICY_CACHE],
        repository=app[HOT_PREFIXES],
        salt=config.salt_bytes,
        metrics=app[METRICS],
        store_text=config.promotion_store_text,
        pause_s=config.promotion_pause_s,
    )
    yield
    await app[PROMOTION].close()
    if redis_counter is not None:
        await redis_counter.close()


async def workers_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60), auto_decompress=False
    )
    pool = WorkerPool(config.worker_urls, session, timeout_s=config.worker_timeout_s)
    app[HTTP_SESSION], app[WORKER_POOL] = session, pool
    pipeline = RequestPipeline(
        pool=pool,
        router=ROUTERS[config.router](),
        salt=config.salt_bytes,
        default_max_tokens=config.default_max_tokens,
        affinity_blocks=config.affinity_blocks,
        prompt_steps=[app[CANONICALIZER]],
        promotion=app[PROMOTION],
    )
    app[PIPELINE] = pipeline
    await pool.check_all()
    checker = asyncio.create_task(pool.run(config.worker_health_interval_s), name="worker-health")
    yield
    await _stop(checker)
    await pipeline.close()
    await session.close()


async def metrics_handler(request: web.Request) -> web.Response:
    metrics, writer = request.app[METRICS], request.app[USAGE_WRITER]
    metrics.spool_depth.set(writer.spool.depth())
    metrics.usage_pending.set(writer.pending)
    metrics.workers_healthy.set(sum(s.healthy for s in request.app[WORKER_POOL].workers.values()))
    refreshed = request.app[POLICY_CACHE].last_refresh_monotonic
    metrics.policy_age.set(-1 if refreshed is None else time.monotonic() - refreshed)
    metrics.hot_prefixes.set(len(request.app[POLICY_CACHE].promoted_hashes))
    body, content_type = metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def openapi_handler(request: web.Request) -> web.Response:
    return web.json_response(openapi_spec())


def create_app(config: GatewayConfig) -> web.Application:
    """The gateway: tenant API, admin API under /admin/v1, /healthz, /metrics, /openapi.json."""
    if config.router not in ROUTERS:
        raise ValueError(f"unknown router {config.router!r}; choose from {sorted(ROUTERS)}")
    if not config.namespace_salt:
        raise ValueError("no namespace salt configured (prepare_data_dir generates one)")
    middlewares = [request_id.request_id_middleware, error_middleware]
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_bytes)
    app.on_response_prepare.append(request_id.add_request_id_header)
    app[CONFIG] = config
    app[UNKNOWN_FIELDS] = UnknownFields()
    app[METRICS] = GatewayMetrics()
    app[CANONICALIZER] = CanonicalizationStep()
    app.cleanup_ctx.extend([rate_limit_ctx, database_ctx, usage_ctx, promotion_ctx, workers_ctx])
    openai_api.add_routes(app)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/openapi.json", openapi_handler)
    app.add_subapp("/admin/v1/", create_admin_app())
    return app
