"""Tenant API: OpenAI-compatible routes. Handlers parse, call the pipeline, serialize."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from gateway import openai_format
from gateway.billing import STATUS_CLIENT_CLOSED, TenantCall, tenant_prices, usage_event
from gateway.errors import APIError, AuthenticationError, RateLimited, Unavailable
from gateway.metrics import GatewayMetrics
from gateway.pipeline import PreparedRequest, new_request_id
from gateway.schemas import ChatRequest, CompletionRequest, parse_chat, parse_completion, read_json
from gateway.state import (
    CANONICALIZER,
    CONFIG,
    DRAIN,
    METRICS,
    PIPELINE,
    POLICY_CACHE,
    RATE_LIMITER,
    USAGE_WRITER,
    WORKER_POOL,
)
from tenancy.policy import TenantPolicy
from tenancy.usage_types import (
    OUTCOME_CLIENT_CANCELLED,
    OUTCOME_CLIENT_ERROR,
    OUTCOME_SERVER_ERROR,
    OUTCOME_SHUTDOWN,
)

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


@contextlib.asynccontextmanager
async def tenant_call(request: web.Request, endpoint: str) -> AsyncIterator[TenantCall]:
    tenant = authenticate(request)
    call = TenantCall(
        tenant=tenant,
        endpoint=endpoint,
        request_id=new_request_id(endpoint),
        key_id=request.config_dict[POLICY_CACHE].key_id(bearer_token(request) or ""),
    )
    started = time.perf_counter()
    try:
        await check_rate_limit(request, tenant)
        yield call
    except APIError as exc:
        call.status = exc.status
        call.outcome = call.outcome or (OUTCOME_CLIENT_ERROR if exc.status < 500 else OUTCOME_SERVER_ERROR)
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        _cut(request, call)
        raise
    except Exception:
        if not call.headers_sent:
            call.status = 500
        call.outcome = call.outcome or OUTCOME_SERVER_ERROR
        raise
    finally:
        _record(request, call, time.perf_counter() - started)


def _cut(request: web.Request, call: TenantCall) -> None:
    """A request ended by a cancellation: the client's doing (499, nginx's convention even after the
    headers went out), unless the gateway is shutting down."""
    if request.config_dict[DRAIN].started:
        call.outcome = call.outcome or OUTCOME_SHUTDOWN
        if not call.headers_sent:
            call.status = 503
    else:
        call.outcome = call.outcome or OUTCOME_CLIENT_CANCELLED
        call.status = STATUS_CLIENT_CLOSED


async def check_rate_limit(request: web.Request, tenant: TenantPolicy) -> None:
    if not await request.config_dict[RATE_LIMITER].allow(tenant.tenant_id, tenant.rate_limit_rpm):
        raise RateLimited(f"rate limit of {tenant.rate_limit_rpm} requests per minute reached")


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
    event = usage_event(call, tenant_prices(call.tenant, request.config_dict[CONFIG]))
    request.config_dict[USAGE_WRITER].submit(event)
    by_tier = event.cached_tokens_by_tier
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
    call.model, call.end_user = parsed.model, parsed.user
    started = time.perf_counter()
    prepared = await pipeline.prepare(call.tenant, parsed, endpoint=call.endpoint, request_id=call.request_id)
    request.config_dict[METRICS].prepare_latency.labels(call.endpoint).observe(time.perf_counter() - started)
    call.num_prompt_tokens = len(prepared.prompt_token_ids)
    call.prepared = prepared
    if prepared.stream:
        return await _stream(request, call, prepared)
    result = await pipeline.generate(prepared)
    call.usage = result.get("usage")
    return openai_format.json_response(formatter(prepared, result), headers=_headers(prepared))


def _headers(prepared: PreparedRequest) -> dict[str, str]:
    if prepared.endpoint != "chat.completions":
        return {}
    return {CANONICALIZED_HEADER: str(prepared.num_canonicalized)}


async def _stream(request: web.Request, call: TenantCall, prepared: PreparedRequest) -> web.StreamResponse:
    """Relay the worker's events; counts the completion tokens whose text reached the client (what a
    cut stream is billed) and says who ended a stream that did not complete."""
    writer = openai_format.ChunkWriter(prepared)
    async with contextlib.aclosing(request.config_dict[PIPELINE].stream(prepared)) as events:
        event = await anext(events, None)  # errors before the first token are plain HTTP errors
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **_headers(prepared)}
        )
        await response.prepare(request)
        call.headers_sent = True
        first = writer.first()
        if first is not None:
            await response.write(first)
        held_tokens = 0  # generated, their text not sent yet (held back or an incomplete character)
        try:
            while event is not None:
                if event.get("type") != "final" and event.get("usage"):
                    call.prompt_usage = event["usage"]
                held_tokens += len(event.get("token_ids") or ())
                if event.get("text"):  # the final event may carry the last token's text too
                    await response.write(writer.delta(event["text"]))
                    call.delivered_tokens, held_tokens = call.delivered_tokens + held_tokens, 0
                if event.get("type") == "final":
                    usage = event.get("usage") or {}
                    await response.write(writer.final(event.get("finish_reason", "stop"), usage))
                    call.delivered_tokens, held_tokens = call.delivered_tokens + held_tokens, 0
                    call.usage = usage
                event = await anext(events, None)
        except APIError as exc:  # after the headers went out: report in the stream, as OpenAI does
            call.outcome = OUTCOME_SERVER_ERROR
            await response.write(writer.error(exc.to_json()))
        except ConnectionResetError:  # the client hung up: recorded, not an error of ours to log
            _cut(request, call)
            return response
        except asyncio.CancelledError:
            if not request.config_dict[DRAIN].started:
                raise  # the client went away
            await _end_for_shutdown(call, response, writer)
            return response
        await response.write(writer.done())
        await response.write_eof()
    return response


async def _end_for_shutdown(
    call: TenantCall, response: web.StreamResponse, writer: openai_format.ChunkWriter
) -> None:
    """The gateway is stopping and its grace ran out: end the stream with an error event (best effort:
    the connection may be closing) so the client knows it was cut, not finished."""
    call.outcome = OUTCOME_SHUTDOWN
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
    error = Unavailable("the gateway is shutting down; the answer was cut short").to_json()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(response.write(writer.error(error) + writer.done()), 1.0)
        await asyncio.wait_for(response.write_eof(), 1.0)


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
    await check_rate_limit(request, tenant)
    parsed = parse_chat(await read_json(await request.read()))
    model = request.config_dict[PIPELINE].resolve_model(parsed.model)
    return openai_format.json_response(request.config_dict[CANONICALIZER].lint(tenant, model, parsed))


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
