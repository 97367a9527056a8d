"""Tenant API: OpenAI-compatible routes. Handlers parse, call the pipeline, serialize."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway import choices, openai_format
from gateway.errors import APIError, AuthenticationError, RateLimited, Unavailable
from gateway.metrics import GatewayMetrics
from gateway.model import ModelRuntime
from gateway.pipeline import PreparedRequest
from gateway.pipeline import new_request_id as new_completion_id
from gateway.request_id import new_request_id, request_id_generated, request_id_of, usage_key
from gateway.schemas import ChatRequest, CompletionRequest, parse_chat, parse_completion, read_json
from gateway.state import (
    CANONICALIZER,
    METRICS,
    PIPELINE,
    POLICY_CACHE,
    RATE_LIMITER,
    UNKNOWN_FIELDS,
    USAGE_WRITER,
    WORKER_POOL,
)
from gateway.tool_calls import ToolCallParser, request_tools
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
    request_id: str  # the x-request-id (the client's or generated): logs, error bodies, usage record
    completion_id: str  # the response's "id" and the worker's request id (always server-generated)
    usage_key: str  # the usage record's unique key (gateway.request_id.usage_key)
    model: str = ""
    status: int = 200
    num_prompt_tokens: int = 0  # known before the worker answers
    usage: dict[str, Any] | None = None  # the worker's usage, when it answered
    prepared: PreparedRequest | None = None  # once the prompt is rendered and routed


@contextlib.asynccontextmanager
async def tenant_call(request: web.Request, endpoint: str) -> AsyncIterator[TenantCall]:
    tenant = authenticate(request)
    x_request_id = request_id_of(request) or new_request_id()
    call = TenantCall(
        tenant=tenant,
        endpoint=endpoint,
        request_id=x_request_id,
        completion_id=new_completion_id(endpoint),
        usage_key=usage_key(x_request_id, request_id_generated(request)),
    )
    started = time.perf_counter()
    try:
        await check_rate_limit(request, tenant)
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
        _record(request, call, time.perf_counter() - started)


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
    usage = call.usage or {}
    by_tier = {tier: int(n) for tier, n in (usage.get("cached_tokens_by_source") or {}).items()}
    event = UsageEvent(
        request_id=call.usage_key,
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


Formatter = Callable[[PreparedRequest, list[dict[str, Any]]], dict[str, Any]]


async def _for_model(
    model: ModelRuntime, parsed: ChatRequest | CompletionRequest
) -> tuple[ChatRequest | CompletionRequest, ToolCallParser | None]:
    """Model-dependent checks; a chat request's forced tool-call grammar and the parser of its answer."""
    choices.check_model_support(model, parsed)
    if not isinstance(parsed, ChatRequest) or not (parsed.tools or parsed.sampling.grammar):
        return parsed, None
    return await asyncio.to_thread(request_tools, parsed, model.tool_style)  # compiles schemas: off the loop


async def _serve(
    request: web.Request, call: TenantCall, parsed: ChatRequest | CompletionRequest, formatter: Formatter
) -> web.StreamResponse:
    pipeline = request.config_dict[PIPELINE]
    call.model = parsed.model
    request.config_dict[UNKNOWN_FIELDS].report(call.endpoint, parsed.unknown_fields)
    parsed, tools = await _for_model(pipeline.resolve_model(parsed.model), parsed)
    if isinstance(parsed, ChatRequest):
        formatter = functools.partial(openai_format.chat_completion, tools=tools)
    started = time.perf_counter()
    prepared = await pipeline.prepare(
        call.tenant,
        parsed,
        endpoint=call.endpoint,
        request_id=call.completion_id,
        x_request_id=call.request_id,
    )
    request.config_dict[METRICS].prepare_latency.labels(call.endpoint).observe(time.perf_counter() - started)
    call.num_prompt_tokens = len(prepared.prompt_token_ids)
    call.prepared = prepared
    if prepared.stream:
        return await _stream(request, call, prepared, tools)
    results = await choices.generate_choices(pipeline, prepared)
    call.usage = choices.combined_usage([r.get("usage") or {} for r in results])
    return openai_format.json_response(formatter(prepared, results), headers=_headers(prepared))


def _headers(prepared: PreparedRequest) -> dict[str, str]:
    if prepared.endpoint != "chat.completions":
        return {}
    return {CANONICALIZED_HEADER: str(prepared.num_canonicalized)}


async def _stream(
    request: web.Request, call: TenantCall, prepared: PreparedRequest, tools: ToolCallParser | None
) -> web.StreamResponse:
    writer = openai_format.ChunkWriter(prepared, tools)
    pipeline = request.config_dict[PIPELINE]
    async with contextlib.aclosing(choices.choice_events(pipeline, prepared)) as events:
        item = await anext(events, None)  # errors before the first token are plain HTTP errors
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **_headers(prepared)}
        )
        await response.prepare(request)
        first = writer.first()
        if first is not None:
            await response.write(first)
        usages: dict[int, dict[str, Any]] = {}
        try:
            while item is not None:
                index, event = item
                if event.get("text") or event.get("logprobs"):  # the final event may carry the last token
                    chunk = writer.delta(event.get("text") or "", index, event.get("logprobs"))
                    if chunk:
                        await response.write(chunk)
                if event.get("type") == "final":
                    usages[index] = event.get("usage") or {}
                    last = len(usages) == prepared.sampling.n
                    call.usage = choices.combined_usage([usages[i] for i in sorted(usages)])
                    reason = event.get("finish_reason", "stop")
                    await response.write(writer.final(reason, call.usage if last else None, index))
                item = await anext(events, None)
        except APIError as exc:  # after the headers went out: report in the stream, as OpenAI does
            call.status = exc.status
            await response.write(writer.error(exc.to_json(call.request_id)))
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
