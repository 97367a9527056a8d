"""A tenant call from authentication to its usage record: the API key, the admission slot, the requests
and tokens per minute, who ended it, and the record and metrics it leaves (``tenant_call``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from aiohttp import web

from gateway.billing import STATUS_CLIENT_CLOSED, TenantCall, tenant_prices, usage_event
from gateway.errors import APIError, AuthenticationError, RateLimited, Unavailable
from gateway.metrics import GatewayMetrics
from gateway.pipeline import PreparedRequest
from gateway.pipeline import new_request_id as new_completion_id
from gateway.ratelimit import RateDecision, requests_key, tokens_key
from gateway.request_id import new_request_id, request_id_generated, request_id_of, usage_key
from gateway.state import (
    ADMISSION,
    CONFIG,
    DRAIN,
    METRICS,
    PIPELINE,
    POLICY_CACHE,
    RATE_LIMITER,
    USAGE_WRITER,
)
from gateway.worker_tokens import refused_unstarted, settle_worker_tokens
from tenancy.policy import TenantPolicy
from tenancy.usage_types import (
    OUTCOME_CLIENT_CANCELLED,
    OUTCOME_CLIENT_ERROR,
    OUTCOME_SERVER_ERROR,
    OUTCOME_SHUTDOWN,
)


def bearer_token(request: web.Request) -> str | None:
    """The bearer token, or None when absent. Keys and tokens are printable ASCII: anything else
    (bytes that are not UTF-8 arrive as surrogates) is refused here, before any hashing sees it."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    if not (token.isascii() and token.isprintable()):
        raise AuthenticationError("malformed Authorization header: the token must be printable ASCII")
    return token


def authenticate(request: web.Request) -> TenantPolicy:
    cache = request.config_dict[POLICY_CACHE]
    token = bearer_token(request)
    if token is None:
        request.config_dict[METRICS].auth_failures.inc()
        raise AuthenticationError("You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.")
    if not cache.ready:
        raise Unavailable("tenant policies are not loaded yet (database unreachable?); retry shortly")
    tenant = cache.authenticate(token)
    if tenant is None:
        request.config_dict[METRICS].auth_failures.inc()
        raise AuthenticationError("Incorrect or revoked API key provided.")
    return tenant


@contextlib.asynccontextmanager
async def tenant_call(request: web.Request, endpoint: str) -> AsyncIterator[TenantCall]:
    tenant = authenticate(request)
    started = time.perf_counter()
    x_request_id = request_id_of(request) or new_request_id()
    call = TenantCall(
        tenant=tenant,
        endpoint=endpoint,
        request_id=x_request_id,
        completion_id=new_completion_id(endpoint),
        usage_key=usage_key(x_request_id, request_id_generated(request)),
        key_id=request.config_dict[POLICY_CACHE].key_id(bearer_token(request) or ""),
        started_s=started,
    )
    gate = request.config_dict[ADMISSION]
    try:
        gate.enter(tenant.tenant_id, tenant.max_concurrent_requests)  # 503/429 at once when full
        call.admission_slots = 1
        decision = await check_rate_limit(request, tenant)
        call.rate_headers, call.requests_counted = decision.headers("requests"), decision.counted
        yield call
    except APIError as exc:
        call.status, call.worker_refused = exc.status, refused_unstarted(call, exc)
        call.outcome = call.outcome or (OUTCOME_CLIENT_ERROR if exc.status < 500 else OUTCOME_SERVER_ERROR)
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        cut_call(request, call)
        raise
    except Exception:
        if not call.headers_sent:
            call.status = 500
        call.outcome = call.outcome or OUTCOME_SERVER_ERROR
        raise
    finally:
        if call.admission_slots:
            gate.leave(tenant.tenant_id, call.admission_slots)
        record_call(request, call, time.perf_counter() - started)
        await settle_worker_tokens(request, call)  # failed or cut: answers settle before they are sent


def cut_call(request: web.Request, call: TenantCall) -> None:
    """A request ended by a cancellation: the client's doing (499, nginx's convention even after the
    headers went out), unless the gateway is shutting down."""
    if request.config_dict[DRAIN].started:
        call.outcome = call.outcome or OUTCOME_SHUTDOWN
        if not call.headers_sent:
            call.status = 503
    else:
        call.outcome = call.outcome or OUTCOME_CLIENT_CANCELLED
        call.status = STATUS_CLIENT_CLOSED


async def check_rate_limit(request: web.Request, tenant: TenantPolicy) -> RateDecision:
    """Count one request against the tenant's requests per minute (its other n - 1 choices are counted
    by ``admit_choices`` once the body is read); 429 when it does not fit."""
    limiter = request.config_dict[RATE_LIMITER]
    decision = await limiter.check(requests_key(tenant.tenant_id), tenant.rate_limit_rpm)
    headers = decision.headers("requests")
    if not decision.allowed:
        raise RateLimited(
            f"rate limit of {tenant.rate_limit_rpm} requests per minute reached",
            retry_after_s=decision.retry_after_s,
            headers=headers,
        )
    return decision


async def check_token_limit(request: web.Request, call: TenantCall, num_tokens: int) -> None:
    """Count a request's tokens (prompt + n × max_tokens) against the tenant's tokens per minute."""
    limit = call.tenant.rate_limit_tpm
    decision = await request.config_dict[RATE_LIMITER].check(
        tokens_key(call.tenant.tenant_id), limit, num_tokens
    )
    call.rate_headers.update(decision.headers("tokens"))
    call.tokens_counted = decision.counted
    if not decision.allowed:
        too_big = limit is not None and num_tokens > limit
        raise RateLimited(
            f"this request needs {num_tokens} tokens (prompt + n × max_tokens) and the limit of {limit} "
            + ("tokens per minute can never fit it" if too_big else "tokens per minute is reached"),
            code="tokens_exceeded" if too_big else "rate_limit_exceeded",
            retry_after_s=decision.retry_after_s,
            headers=call.rate_headers,
        )


async def check_worker_tokens(request: web.Request, call: TenantCall, num_tokens: int) -> None:
    """``check_token_limit`` for a bundled-worker request, remembered for ``settle_worker_tokens``."""
    await check_token_limit(request, call, num_tokens)
    call.worker_limit_tokens = num_tokens


def _record_prompt_work(
    metrics: GatewayMetrics, tenant_id: str, prepared: PreparedRequest, cached_tokens: int
) -> None:
    """Canonicalization and promotion counters of one request."""
    if prepared.num_canonicalized:
        metrics.canonicalization_fragments.of(tenant_id, "moved").inc(prepared.num_canonicalized)
    if prepared.num_reported:
        metrics.canonicalization_fragments.of(tenant_id, "reported").inc(prepared.num_reported)
    if prepared.near_miss_exact_tokens is not None:
        metrics.near_miss_tokens.of(tenant_id).inc(prepared.near_miss_tokens(cached_tokens))
    if prepared.promoted_prefix_tokens and cached_tokens:
        # Reuse runs from the start of the prompt, so the promoted part is reused first.
        metrics.promoted_prefix_tokens.of(tenant_id).inc(min(cached_tokens, prepared.promoted_prefix_tokens))


def record_call(request: web.Request, call: TenantCall, elapsed_s: float) -> None:
    event = usage_event(call, tenant_prices(call.tenant, request.config_dict[CONFIG]))
    request.config_dict[USAGE_WRITER].submit(event)
    by_tier = event.cached_tokens_by_tier
    metrics = request.config_dict[METRICS]
    tenant_id = call.tenant.tenant_id
    metrics.requests.of(tenant_id, call.endpoint, str(call.status)).inc()
    metrics.latency.labels(call.endpoint).observe(elapsed_s)
    metrics.prompt_tokens.of(tenant_id).inc(event.prompt_tokens)
    metrics.completion_tokens.of(tenant_id).inc(event.completion_tokens)
    metrics.saved_prefill_seconds.of(tenant_id).inc(event.saved_prefill_ms / 1000)
    for tier, count in by_tier.items():
        metrics.cached_tokens.of(tenant_id, tier).inc(count)
    if call.prepared is not None:
        _record_prompt_work(metrics, tenant_id, call.prepared, event.cached_tokens)
        if call.status == 200 and call.usage is not None:  # served: only now may it count for promotion
            request.config_dict[PIPELINE].served(call.prepared)
        else:  # refused by the worker, failed or cut: no follower may wait for its prefill
            request.config_dict[PIPELINE].abandon(call.prepared.route_request)
