"""Typed application state keys (no module globals: everything lives on the app)."""

from __future__ import annotations

import aiohttp
from aiohttp import web
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from gateway.admission import AdmissionGate
from gateway.canonicalization import CanonicalizationStep
from gateway.config import GatewayConfig
from gateway.drain import Drain
from gateway.kv_consumer import KVEventConsumer
from gateway.kv_index import PrefixIndex
from gateway.metrics import GatewayMetrics
from gateway.near_miss import NearMissRouting
from gateway.parameters import UnknownFields
from gateway.pipeline import RequestPipeline
from gateway.promotion import HotPrefixPromotion
from gateway.ratelimit import RateLimiter
from gateway.upstream_openai import UpstreamRegistry
from gateway.workers import WorkerPool
from tenancy.cache import PolicyCache
from tenancy.hot_prefixes import HotPrefixRepository
from tenancy.repository import TenantRepository
from tenancy.usage import UsageWriter

CONFIG = web.AppKey("config", GatewayConfig)
ADMISSION = web.AppKey("admission", AdmissionGate)
METRICS = web.AppKey("metrics", GatewayMetrics)
RATE_LIMITER = web.AppKey("rate_limiter", RateLimiter)  # type: ignore[type-abstract]
ENGINE = web.AppKey("engine", AsyncEngine)
SESSIONMAKER = web.AppKey("sessionmaker", async_sessionmaker[AsyncSession])
REPOSITORY = web.AppKey("repository", TenantRepository)
POLICY_CACHE = web.AppKey("policy_cache", PolicyCache)
USAGE_WRITER = web.AppKey("usage_writer", UsageWriter)
HTTP_SESSION = web.AppKey("http_session", aiohttp.ClientSession)
WORKER_POOL = web.AppKey("worker_pool", WorkerPool)
UPSTREAMS = web.AppKey("upstreams", UpstreamRegistry)  # external OpenAI-compatible upstreams
PIPELINE = web.AppKey("pipeline", RequestPipeline)
CANONICALIZER = web.AppKey("canonicalizer", CanonicalizationStep)
HOT_PREFIXES = web.AppKey("hot_prefixes", HotPrefixRepository)
PROMOTION = web.AppKey("promotion", HotPrefixPromotion)
DRAIN = web.AppKey("drain", Drain)
PREFIX_INDEX = web.AppKey("prefix_index", PrefixIndex)
NEAR_MISS = web.AppKey("near_miss", NearMissRouting)
KV_CONSUMER = web.AppKey("kv_consumer", KVEventConsumer)
UNKNOWN_FIELDS = web.AppKey("unknown_fields", UnknownFields)  # logged once per field name
NAMESPACE_EPOCH = web.AppKey("namespace_epoch", int)  # of the secret in use (-1: configured)
