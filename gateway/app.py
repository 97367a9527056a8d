"""The gateway's aiohttp application factory; resources live in ``cleanup_ctx``."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from aiohttp import web

from gateway import openai_api, request_id, tenant_calls
from gateway.admin_api import check_admin_token, create_admin_app
from gateway.admission import AdmissionGate
from gateway.canonicalization import CanonicalizationStep
from gateway.config import GatewayConfig
from gateway.cpu import CpuPool
from gateway.drain import Drain, on_shutdown
from gateway.embedding import PromptEmbedder
from gateway.errors import AuthenticationError, error_middleware
from gateway.expect import close_uninvited, expect_continue, route_everything
from gateway.kv_consumer import KVEventConsumer
from gateway.kv_index import PrefixIndex
from gateway.kv_relay import RedisKVRelay
from gateway.metrics import TENANT_LABEL_MODES, GatewayMetrics
from gateway.namespace_secret import namespace_secret_ctx
from gateway.near_miss import NearMissRouting
from gateway.near_miss_findings import LocalFindings, RedisFindings
from gateway.openapi import openapi_spec
from gateway.parameters import UnknownFields
from gateway.pipeline import RequestPipeline
from gateway.promotion import HotPrefixPromotion
from gateway.promotion_redis import RedisPromotionCounter
from gateway.ratelimit import LocalRateLimiter, RedisRateLimiter
from gateway.routing import ROUTERS
from gateway.slow_clients import STARTED, read_body_middleware
from gateway.state import (
    ADMISSION,
    CANONICALIZER,
    CONFIG,
    DRAIN,
    ENGINE,
    HOT_PREFIXES,
    HTTP_SESSION,
    KV_CONSUMER,
    METRICS,
    NEAR_MISS,
    PIPELINE,
    POLICY_CACHE,
    PREFIX_INDEX,
    PROMOTION,
    RATE_LIMITER,
    REPOSITORY,
    SESSIONMAKER,
    UNKNOWN_FIELDS,
    UPSTREAMS,
    USAGE_WRITER,
    WORKER_POOL,
)
from gateway.tenant_calls import bearer_token
from gateway.upstream_openai import UpstreamRegistry
from gateway.workers import WorkerPool
from policies.isolation import tenant_namespace_id
from policies.promotion import InMemoryPromotionCounter, PromotionCounter, PromotionPolicy
from tenancy.cache import PolicyCache
from tenancy.db import create_engine, create_sessionmaker
from tenancy.hot_prefixes import HotPrefixRepository
from tenancy.keys import tokens_equal
from tenancy.repository import TenantRepository
from tenancy.spool import UsageSpool
from tenancy.usage import UsageWriter

log = logging.getLogger(__name__)


async def _stop(task: asyncio.Task, timeout_s: float = 5.0) -> None:
    """Cancel a background task and wait a bounded time for it to end (it must not hold the shutdown)."""
    task.cancel()
    _, pending = await asyncio.wait({task}, timeout=timeout_s)
    if pending:
        log.warning("background task %s did not stop within %.0f s", task.get_name(), timeout_s)


async def rate_limit_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    app[RATE_LIMITER] = (
        RedisRateLimiter(config.redis_url, pause_s=config.ratelimit_pause_s)
        if config.redis_url
        else LocalRateLimiter()
    )
    yield
    await app[RATE_LIMITER].close()


async def database_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    engine = create_engine(config.resolved_database_url)
    sessionmaker = create_sessionmaker(engine)
    repository = TenantRepository(sessionmaker)
    # Every replica drops a deleted tenant's metric series when its reload no longer shows the tenant.
    cache = PolicyCache(repository, refresh_s=config.policy_refresh_s, on_reload=app[METRICS].forget_tenants)
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
    try:  # a hung database must not hold the shutdown
        await asyncio.wait_for(engine.dispose(), config.usage_db_timeout_s)
    except TimeoutError:
        log.warning("database connections did not close within %.0f s", config.usage_db_timeout_s)


async def usage_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    writer = UsageWriter(
        app[SESSIONMAKER],
        UsageSpool(config.resolved_spool_path),
        flush_s=config.usage_flush_s,
        batch_max=config.usage_batch_max,
        db_timeout_s=config.usage_db_timeout_s,
        rejected_retry_s=config.usage_rejected_retry_s,
    )
    app[USAGE_WRITER] = writer
    task = asyncio.create_task(writer.run(), name="usage-writer")
    yield
    await _stop(task)  # a flush cancelled half-way spools its batch
    await writer.close()  # bounded: one database try, else the spool


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
    headers = {"Authorization": f"Bearer {config.worker_secret}"} if config.worker_secret else None
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60), auto_decompress=False, headers=headers
    )
    pool = WorkerPool(
        config.worker_urls,
        session,
        timeout_s=config.worker_timeout_s,
        health_timeout_s=config.worker_health_timeout_s,
        kv_events_max_bytes=config.kv_events_max_bytes,
    )
    cpu = CpuPool(num_threads=config.cpu_threads, max_waiting=config.cpu_queue_max)
    app[HTTP_SESSION], app[WORKER_POOL] = session, pool
    app[PREFIX_INDEX] = prefix_index = PrefixIndex(max_remote_ttl_s=config.kv_index_max_remote_ttl_s)
    relay = None
    if config.redis_url and config.kv_index:  # replicas share the workers' event streams
        relay = RedisKVRelay(config.redis_url, replica_id=secrets.token_hex(8))
    app[KV_CONSUMER] = consumer = KVEventConsumer(pool, prefix_index, relay=relay, metrics=app[METRICS])
    # The embedder loads (and imports torch) only when a near-miss tenant first needs it.
    embedder = PromptEmbedder(
        cache_dir=Path(config.near_miss_cache_dir or config.data_dir / "embeddings"),
        backend=config.near_miss_embedding,
        metrics=app[METRICS],
    )
    findings = (
        RedisFindings(config.redis_url, salt=config.salt_bytes) if config.redis_url else LocalFindings()
    )
    app[NEAR_MISS] = near_miss = NearMissRouting(
        embedder=embedder,
        metrics=app[METRICS],
        min_blocks=config.near_miss_min_blocks,
        max_wait_s=config.near_miss_max_wait_ms / 1000,
        findings=findings,
        policies=app[POLICY_CACHE],
        # The KV-aware router over the KV-event index: FAISS only for what the index cannot see yet.
        exact_index_live=config.kv_index and config.router == "kv_aware",
    )
    pipeline = RequestPipeline(
        pool=pool,
        router=ROUTERS[config.router](),
        salt=config.salt_bytes,
        default_max_tokens=config.default_max_tokens,
        affinity_blocks=config.affinity_blocks,
        prompt_steps=[app[CANONICALIZER]],
        promotion=app[PROMOTION],
        cpu=cpu,
        max_prompt_chars=config.max_prompt_chars,
        prefix_index=prefix_index,
        near_miss=near_miss,
        max_answer_units=config.max_answer_units,
    )
    app[PIPELINE] = pipeline
    await pool.check_all()
    checker = asyncio.create_task(pool.run(config.worker_health_interval_s), name="worker-health")
    if config.kv_index:
        consumer.start()
    yield
    await consumer.close()
    await near_miss.close()
    await _stop(checker)
    await pipeline.close()
    cpu.close()
    await session.close()


async def upstreams_ctx(app: web.Application) -> AsyncIterator[None]:
    """External OpenAI-compatible upstreams, on their own session: it carries no worker secret."""
    config = app[CONFIG]
    session = None
    if config.openai_upstreams:
        # Idle connections are dropped before uvicorn's default 5 s keep-alive closes them on the other
        # side: a request sent on a connection the server is closing fails as "disconnected" (502).
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
        session = aiohttp.ClientSession(connector=connector)
    app[UPSTREAMS] = upstreams = UpstreamRegistry(config.openai_upstreams, session)
    upstreams.start(app[METRICS].registry)  # URL health metrics, active probes
    yield
    await upstreams.close()
    if session is not None:
        await session.close()


async def metrics_handler(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    given = bearer_token(request)
    accepted = [token for token in (config.metrics_token, config.admin_token) if token]
    if given is None or not any(tokens_equal(given, token) for token in accepted):
        raise AuthenticationError(
            "/metrics needs 'Authorization: Bearer <PREFIXGATE_METRICS_TOKEN or the admin token>'",
            code="invalid_metrics_token",
        )
    metrics, writer = request.app[METRICS], request.app[USAGE_WRITER]
    metrics.spool_depth.set(writer.spool_depth())
    metrics.usage_pending.set(writer.pending)
    metrics.usage_rejected.set(writer.rejected.depth())
    metrics.usage_write_failures.labels("database").set(writer.num_db_failures)
    metrics.usage_write_failures.labels("spool").set(writer.num_spool_failures)
    metrics.workers_healthy.set(sum(s.healthy for s in request.app[WORKER_POOL].workers.values()))
    refreshed = request.app[POLICY_CACHE].last_refresh_monotonic
    metrics.policy_age.set(-1 if refreshed is None else time.monotonic() - refreshed)
    metrics.hot_prefixes.set(len(request.app[POLICY_CACHE].promoted_hashes))
    metrics.in_flight.set(request.app[ADMISSION].in_flight)
    body, content_type = metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def openapi_handler(request: web.Request) -> web.Response:
    return web.json_response(openapi_spec())


def authorize_from_headers(request: web.Request) -> str | None:
    """Before a body is read: its route's credentials, from the headers alone (401/403 without reading).
    Who is asking ("admin", "tenant:<id>"), or None for a route that authorizes nothing (takes no body)."""
    if request.path.startswith("/admin/"):
        check_admin_token(request)
        return "admin"
    if request.path.startswith("/v1/"):
        return "tenant:" + tenant_calls.authenticate(request).tenant_id
    return None


def create_app(config: GatewayConfig) -> web.Application:
    """The gateway: tenant API, admin API under /admin/v1, /healthz, /metrics, /openapi.json."""
    if config.router not in ROUTERS:
        raise ValueError(f"unknown router {config.router!r}; choose from {sorted(ROUTERS)}")
    middlewares = [
        request_id.request_id_middleware,
        error_middleware,
        read_body_middleware(
            config.read_timeout_s,
            config.max_body_bytes,
            config.max_reading_body_bytes,
            authorize_from_headers,
        ),
    ]
    # auto_decompress off: bodies are decoded by read_body_middleware (gateway.content_encoding).
    app = web.Application(
        middlewares=middlewares,
        client_max_size=config.max_body_bytes,
        handler_args={"auto_decompress": False},
    )
    app.on_response_prepare.append(request_id.add_request_id_header)
    app.on_response_prepare.append(close_uninvited)
    app[STARTED] = weakref.WeakSet()
    app[CONFIG] = config
    app[UNKNOWN_FIELDS] = UnknownFields()
    app[ADMISSION] = AdmissionGate(
        max_in_flight=config.max_in_flight, tenant_share=config.tenant_in_flight_share
    )
    if config.metrics_tenant_labels not in TENANT_LABEL_MODES:
        raise ValueError(f"metrics_tenant_labels must be one of {TENANT_LABEL_MODES}")
    hashed = config.metrics_tenant_labels == "hash"
    # The salt is read when a label is made: it may come from the database once the app has started.
    app[METRICS] = GatewayMetrics(
        tenant_label=(lambda tenant_id: tenant_namespace_id(app[CONFIG].salt_bytes, tenant_id))
        if hashed
        else None
    )
    app[CANONICALIZER] = CanonicalizationStep()
    app[DRAIN] = Drain(grace_s=config.shutdown_grace_s)
    app.on_shutdown.append(on_shutdown(app[DRAIN]))
    app.cleanup_ctx.extend(
        [
            rate_limit_ctx,
            database_ctx,
            namespace_secret_ctx,
            usage_ctx,
            promotion_ctx,
            workers_ctx,
            upstreams_ctx,
        ]
    )
    openai_api.add_routes(app)
    app.router.add_get("/metrics", metrics_handler, expect_handler=expect_continue)
    app.router.add_get("/openapi.json", openapi_handler, expect_handler=expect_continue)
    app.add_subapp("/admin/v1/", create_admin_app())
    route_everything(app)
    return app
