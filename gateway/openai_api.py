"""Tenant API: OpenAI-compatible routes. Handlers parse, call the pipeline, serialize."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway import openai_format
from gateway.errors import APIError, AuthenticationError, RateLimited, Unavailable
from gateway.metrics import GatewayMetrics
from gateway.pipeline import PreparedRequest, new_request_id
from gateway.schemas import ChatRequest, CompletionRequest, parse_chat, parse_completion, read_json
from gateway.state import (
    ADMISSION,
    CANONICALIZER,
    METRICS,
    PIPELINE,
    POLICY_CACHE,
    RATE_LIMITER,
    USAGE_WRITER,
    WORKER_POOL,
)
from tenancy.policy import TenantPolicy
from tenancy.usage_types import UsageEvent

STATUS_CLIENT_CLOSED = 499  # nginx's convention for "client closed the request"
CANONICALIZED_HEADER = "x-prefixgate-canonicalized"  # dynamic fragments moved out of the prefix


def bearer_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


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


@dataclass(slots=True)
class TenantCall:
    """What one tenant request did, for its usage record and metrics."""

    tenant: TenantPolicy
    endpoint: str
    request_id: str
    model: str = ""
    status: int = 200
    num_prompt_tokens: int = 0  # known before the worker answers
    usage: dict[str, Any] | None = None  # the worker's usage, when it answered
    prepared: PreparedRequest | None = None  # once the prompt is rendered and routed
    rate_headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-* of this request
    started_s: float = 0.0  # time.perf_counter() when it arrived (queue time, TTFT)


@contextlib.asynccontextmanager
async def tenant_call(request: web.Request, endpoint: str) -> AsyncIterator[TenantCall]:
    tenant = authenticate(request)
    started = time.perf_counter()
    call = TenantCall(
        tenant=tenant, endpoint=endpoint, request_id=new_request_id(endpoint), started_s=started
    )
    gate = request.config_dict[ADMISSION]
    entered = False
    try:
        gate.enter(tenant.tenant_id, tenant.max_concurrent_requests)  # 503/429 at once when full
        entered = True
        call.rate_headers = await check_rate_limit(request, tenant)
        yield call
    except APIError as exc:
        call.status = exc.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        call.status = STATUS_CLIENT_CLOSED
        raise
    except Exception:
        call.status = 500
        raise
    finally:
        if entered:
            gate.leave(tenant.tenant_id)
        _record(request, call, time.perf_counter() - started)


async def check_rate_limit(request: web.Request, tenant: TenantPolicy) -> dict[str, str]:
    """Count one request against the tenant's requests per minute; its x-ratelimit-* headers."""
    decision = await request.config_dict[RATE_LIMITER].check(f"r:{tenant.tenant_id}", tenant.rate_limit_rpm)
    headers = decision.headers("requests")
    if not decision.allowed:
        raise RateLimited(
            f"rate limit of {tenant.rate_limit_rpm} requests per minute reached",
            retry_after_s=decision.retry_after_s,
            headers=headers,
        )
    return headers


async def check_token_limit(request: web.Request, call: TenantCall, num_tokens: int) -> None:
    """Count a request's tokens (prompt + max_tokens) against the tenant's tokens per minute."""
    limit = call.tenant.rate_limit_tpm
    decision = await request.config_dict[RATE_LIMITER].check(f"t:{call.tenant.tenant_id}", limit, num_tokens)
    call.rate_headers.update(decision.headers("tokens"))
    if not decision.allowed:
        too_big = limit is not None and num_tokens > limit
        raise RateLimited(
            f"this request needs {num_tokens} tokens (prompt + max_tokens) and the limit of {limit} "
            + ("tokens per minute can never fit it" if too_big else "tokens per minute is reached"),
            code="tokens_exceeded" if too_big else "rate_limit_exceeded",
            retry_after_s=decision.retry_after_s,
            headers=call.rate_headers,
        )


def _record_prompt_work(
    metrics: GatewayMetrics, tenant: str, prepared: PreparedRequest, cached_tokens: int
) -> None:
    """Canonicalization and promotion counters of one request."""
    if prepared.num_canonicalized:
        metrics.canonicalization_fragments.labels(tenant, "moved").inc(prepared.num_canonicalized)
    if prepared.num_reported:
        metrics.canonicalization_fragments.labels(tenant, "reported").inc(prepared.num_reported)
    if prepared.promoted_prefix_tokens and cached_tokens:
        # Reuse runs from the start of the prompt, so the promoted part is reused first.
        metrics.promoted_prefix_tokens.labels(tenant).inc(min(cached_tokens, prepared.promoted_prefix_tokens))


def _record(request: web.Request, call: TenantCall, elapsed_s: float) -> None:
    usage = call.usage or {}
    by_tier = {tier: int(n) for tier, n in (usage.get("cached_tokens_by_source") or {}).items()}
    event = UsageEvent(
        request_id=call.request_id,
        tenant_id=call.tenant.tenant_id,
        model=call.model,
        endpoint=call.endpoint,
        status=call.status,
        prompt_tokens=int(usage.get("prompt_tokens", call.num_prompt_tokens)),
        cached_tokens=int(usage.get("cached_tokens", 0)),
        cached_tokens_by_tier=by_tier,
        completion_tokens=int(usage.get("completion_tokens", 0)),
        prefill_ms=float(usage.get("prefill_ms", 0.0)),
        saved_prefill_ms=float(usage.get("estimated_saved_prefill_ms", 0.0)),
    )
    request.config_dict[USAGE_WRITER].submit(event)
    metrics, tenant = request.config_dict[METRICS], call.tenant.tenant_id
    metrics.requests.labels(tenant, call.endpoint, str(call.status)).inc()
    metrics.latency.labels(call.endpoint).observe(elapsed_s)
    metrics.prompt_tokens.labels(tenant).inc(event.prompt_tokens)
    metrics.completion_tokens.labels(tenant).inc(event.completion_tokens)
    metrics.saved_prefill_seconds.labels(tenant).inc(event.saved_prefill_ms / 1000)
    for tier, count in by_tier.items():
        metrics.cached_tokens.labels(tenant, tier).inc(count)
    if call.prepared is not None:
        _record_prompt_work(metrics, tenant, call.prepared, event.cached_tokens)


Formatter = Callable[[PreparedRequest, dict[str, Any]], dict[str, Any]]


async def _serve(
    request: web.Request, call: TenantCall, parsed: ChatRequest | CompletionRequest, formatter: Formatter
) -> web.StreamResponse:
    pipeline = request.config_dict[PIPELINE]
    call.model = parsed.model
    started = time.perf_counter()
    prepared = await pipeline.prepare(call.tenant, parsed, endpoint=call.endpoint, request_id=call.request_id)
    metrics = request.config_dict[METRICS]
    metrics.prepare_latency.labels(call.endpoint).observe(time.perf_counter() - started)
    num_prompt_tokens = len(prepared.prompt_token_ids)
    await check_token_limit(request, call, num_prompt_tokens + (prepared.sampling.max_tokens or 0))
    call.num_prompt_tokens = num_prompt_tokens  # from here on the request counts (a 429 bills nothing)
    call.prepared = prepared
    metrics.queue_time.labels(call.endpoint).observe(time.perf_counter() - call.started_s)
    if prepared.stream:
        return await _stream(request, call, prepared)
    result = await pipeline.generate(prepared)
    call.usage = result.get("usage")
    return openai_format.json_response(formatter(prepared, result), headers=_headers(call, prepared))


def _headers(call: TenantCall, prepared: PreparedRequest) -> dict[str, str]:
    if prepared.endpoint != "chat.completions":
        return dict(call.rate_headers)
    return {**call.rate_headers, CANONICALIZED_HEADER: str(prepared.num_canonicalized)}


async def _stream(request: web.Request, call: TenantCall, prepared: PreparedRequest) -> web.StreamResponse:
    writer = openai_format.ChunkWriter(prepared)
    async with contextlib.aclosing(request.config_dict[PIPELINE].stream(prepared)) as events:
        event = await anext(events, None)  # errors before the first token are plain HTTP errors
        request.config_dict[METRICS].ttft.labels(call.endpoint).observe(time.perf_counter() - call.started_s)
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **_headers(call, prepared),
            }
        )
        await response.prepare(request)
        first = writer.first()
        if first is not None:
            await response.write(first)
        try:
            while event is not None:
                if event.get("text"):  # the final event may carry the last token's text too
                    await response.write(writer.delta(event["text"]))
                if event.get("type") == "final":
                    call.usage = event.get("usage") or {}
                    await response.write(writer.final(event.get("finish_reason", "stop"), call.usage))
                event = await anext(events, None)
        except APIError as exc:  # after the headers went out: report in the stream, as OpenAI does
            call.status = exc.status
            await response.write(writer.error(exc.to_json()))
        await response.write(writer.done())
        await response.write_eof()
    return response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    async with tenant_call(request, "chat.completions") as call:
        parsed = parse_chat(await read_json(await request.read()))
        return await _serve(request, call, parsed, openai_format.chat_completion)


async def completions(request: web.Request) -> web.StreamResponse:
    async with tenant_call(request, "completions") as call:
        parsed = parse_completion(await read_json(await request.read()))
        return await _serve(request, call, parsed, openai_format.completion)


async def prompt_lint(request: web.Request) -> web.Response:
    """What canonicalization would change in a chat request, and the prompt tokens of reuse it costs.
    Rate-limited like any tenant call; not billed (no usage record)."""
    tenant = authenticate(request)
    headers = await check_rate_limit(request, tenant)
    parsed = parse_chat(await read_json(await request.read()))
    pipeline = request.config_dict[PIPELINE]
    model = pipeline.resolve_model(parsed.model)
    pipeline.check_prompt_size(parsed, model, context_window=False)
    lint = await pipeline.run_cpu(request.config_dict[CANONICALIZER].lint, tenant, model, parsed)
    return openai_format.json_response(lint, headers=headers)


def _model_json(model_id: str, max_model_len: int) -> dict[str, Any]:
    return {
        "id": model_id,
        "object": "model",
        "created": 0,
        "owned_by": "prefixgate",
        "max_model_len": max_model_len,
    }


async def list_models(request: web.Request) -> web.Response:
    authenticate(request)
    models = request.config_dict[WORKER_POOL].models
    data = [_model_json(model_id, group.runtime.max_model_len) for model_id, group in sorted(models.items())]
    return web.json_response({"object": "list", "data": data})


async def get_model(request: web.Request) -> web.Response:
    authenticate(request)
    model = request.config_dict[PIPELINE].resolve_model(request.match_info["model"])
    return web.json_response(_model_json(model.model_id, model.max_model_len))


async def healthz(request: web.Request) -> web.Response:
    pool, cache = request.config_dict[WORKER_POOL], request.config_dict[POLICY_CACHE]
    healthy = sum(state.healthy for state in pool.workers.values())
    ready = healthy > 0 and cache.ready
    body = {
        "status": "ok" if ready else "starting",
        "workers_healthy": healthy,
        "workers_total": len(pool.workers),
        "policies_loaded": cache.ready,
        "models": sorted(pool.models),
    }
    return web.json_response(body, status=200 if ready else 503)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/prompt-lint", prompt_lint)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/healthz", healthz)
