"""Tenant API: OpenAI-compatible routes. Handlers parse, call the pipeline, serialize."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web

from gateway import choices, openai_format, upstream_serve
from gateway.admission import admit_choices
from gateway.billing import UNKNOWN_MODEL, TenantCall
from gateway.errors import (
    APIError,
    InvalidRequest,
    ResponseFormatError,
    Unavailable,
)
from gateway.expect import expect_continue
from gateway.model import ModelRuntime
from gateway.pipeline import PreparedRequest
from gateway.request_body import ParsedBody, read_request
from gateway.schemas import ChatRequest, CompletionRequest, parse_chat, parse_completion
from gateway.slow_clients import AnswerCut, ClientStream, send_answer
from gateway.state import (
    ADMISSION,
    CANONICALIZER,
    CONFIG,
    DRAIN,
    METRICS,
    NEAR_MISS,
    PIPELINE,
    POLICY_CACHE,
    RATE_LIMITER,
    UNKNOWN_FIELDS,
    UPSTREAMS,
    WORKER_POOL,
)
from gateway.tenant_calls import (
    authenticate,
    check_rate_limit,
    check_token_limit,
    check_worker_tokens,
    cut_call,
    tenant_call,
)
from gateway.tool_calls import ToolCallParser, request_tools
from gateway.worker_tokens import settle_worker_tokens
from tenancy.usage_types import (
    OUTCOME_FORMAT_ERROR,
    OUTCOME_SERVER_ERROR,
    OUTCOME_SHUTDOWN,
)

log = logging.getLogger(__name__)

CANONICALIZED_HEADER = "x-prefixgate-canonicalized"  # dynamic fragments moved out of the prefix


Formatter = Callable[[PreparedRequest, list[dict[str, Any]]], dict[str, Any]]


@contextlib.contextmanager
def _formatting(call: TenantCall) -> Iterator[None]:
    """Formatting the worker's answer: a failure (a gateway bug, or a worker speaking another protocol
    version) is a clear 500 or stream error event, logged with its cause, and recorded under
    ``format_error`` with the tokens the worker used (gateway.billing)."""
    try:
        yield
    except APIError:
        raise
    except Exception as exc:
        call.outcome = OUTCOME_FORMAT_ERROR
        log.exception(
            "could not format the answer of %s (x-request-id %s)", call.completion_id, call.request_id
        )
        raise ResponseFormatError(
            "the model's answer could not be formatted as an OpenAI response (a server fault, logged under "
            "this request id); what was not delivered is not billed"
        ) from exc


async def _for_model(
    model: ModelRuntime, parsed: ChatRequest | CompletionRequest
) -> tuple[ChatRequest | CompletionRequest, ToolCallParser | None]:
    """Model-dependent checks; a chat request's forced tool-call grammar and the parser of its answer."""
    choices.check_model_support(model, parsed)
    if not isinstance(parsed, ChatRequest) or not (parsed.tools or parsed.sampling.grammar):
        return parsed, None
    return await asyncio.to_thread(request_tools, parsed, model.tool_style)  # compiles schemas: off the loop


def _served_model(request: web.Request, model_id: str) -> str:
    """The model a usage record names: the request's if this gateway serves it (a bundled worker's or an
    external upstream's), else ``UNKNOWN_MODEL`` (invented names would each make a report row, for free)."""
    app = request.config_dict
    if app[UPSTREAMS].upstream_for(model_id) is not None or app[WORKER_POOL].model(model_id) is not None:
        return model_id
    return UNKNOWN_MODEL


async def _serve(
    request: web.Request, call: TenantCall, body: ParsedBody, formatter: Formatter
) -> web.StreamResponse:
    pipeline, parsed = request.config_dict[PIPELINE], body.request
    call.model, call.end_user = _served_model(request, parsed.model), parsed.user
    request.config_dict[UNKNOWN_FIELDS].report(call.endpoint, parsed.unknown_fields)
    call.admission_slots = await admit_choices(  # n choices count n requests (gateway/admission.py)
        request.config_dict[ADMISSION],
        request.config_dict[RATE_LIMITER],
        call.tenant,
        parsed.sampling.n,
        call.rate_headers,
        call.requests_counted,
    )
    upstream = request.config_dict[UPSTREAMS].upstream_for(parsed.model)
    if upstream is not None:  # an external OpenAI-compatible upstream (gateway.upstream_serve)
        forwarded = await upstream_serve.prepare(request, call, parsed, upstream, body.raw)
        await check_token_limit(request, call, forwarded.num_limit_tokens)
        return await upstream_serve.respond(request, call, forwarded)
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
        # Before routing (a refused request places nothing); OpenAI counts all n choices' max_tokens too.
        check_tokens=functools.partial(check_worker_tokens, request, call),
        arrived_s=call.started_s,
    )
    metrics = request.config_dict[METRICS]
    metrics.prepare_latency.labels(call.endpoint).observe(time.perf_counter() - started)
    call.num_prompt_tokens = len(prepared.prompt_token_ids)  # from here on it counts (a 429 bills nothing)
    call.prepared = prepared
    metrics.queue_time.labels(call.endpoint).observe(time.perf_counter() - call.started_s)
    if prepared.stream:
        return await _stream(request, call, prepared, tools)
    results = await choices.generate_choices(pipeline, prepared, on_tokens=call.count_generated)
    call.usage = choices.combined_usage([r.get("usage") or {} for r in results])
    await settle_worker_tokens(request, call)  # before the answer: the client's next request sees it
    with _formatting(call):
        answer = openai_format.json_response(formatter(prepared, results), headers=_headers(call, prepared))
    await send_answer(request, call, answer)
    return answer


def _headers(call: TenantCall, prepared: PreparedRequest) -> dict[str, str]:
    if prepared.endpoint != "chat.completions":
        return dict(call.rate_headers)
    return {**call.rate_headers, CANONICALIZED_HEADER: str(prepared.num_canonicalized)}


async def _stream(
    request: web.Request, call: TenantCall, prepared: PreparedRequest, tools: ToolCallParser | None
) -> web.StreamResponse:
    """Relay the worker's events (of every choice); counts the completion tokens whose text reached the
    client (what a cut stream is billed) and says who ended a stream that did not complete."""
    writer = openai_format.ChunkWriter(prepared, tools)
    pipeline = request.config_dict[PIPELINE]
    events = choices.choice_events(pipeline, prepared, on_tokens=call.count_generated)
    async with contextlib.aclosing(events) as events:
        item = await anext(events, None)  # errors before the first token are plain HTTP errors
        request.config_dict[METRICS].ttft.labels(call.endpoint).observe(time.perf_counter() - call.started_s)
        response = await openai_format.start_event_stream(request, _headers(call, prepared))
        call.headers_sent = True
        # Marked with the completion tokens written: a cut bills those whose bytes left the gateway.
        out = ClientStream(request, response, request.config_dict[CONFIG].stream_write_timeout_s, 0)
        usages: dict[int, dict[str, Any]] = {}  # each choice's final usage
        held: dict[int, int] = {}  # per choice: tokens generated whose text is not sent yet
        try:
            try:
                with _formatting(call):
                    first = writer.first()
                if first is not None:
                    await out.write(first)
                while item is not None:
                    index, event = item
                    if event.get("type") != "final" and event.get("usage") and call.prompt_usage is None:
                        call.prompt_usage = event["usage"]
                    num_new = len(event.get("token_ids") or ())  # generated_tokens: counted on arrival
                    held[index] = held.get(index, 0) + num_new
                    if event.get("text") or event.get("logprobs"):  # the final event may carry the last token
                        with _formatting(call):
                            chunk = writer.delta(event.get("text") or "", index, event.get("logprobs"))
                        if chunk:
                            await out.write(chunk)
                            call.delivered_tokens += held.pop(index, 0)
                            out.mark(call.delivered_tokens)
                    if event.get("type") == "final":
                        usages[index] = event.get("usage") or {}
                        last = len(usages) == prepared.sampling.n
                        usage = choices.combined_usage([usages[i] for i in sorted(usages)]) if last else None
                        reason = event.get("finish_reason", "stop")
                        with _formatting(call):
                            chunk = writer.final(reason, usage, index)
                        await out.write(chunk)
                        call.delivered_tokens += held.pop(index, 0)
                        out.mark(call.delivered_tokens)
                        if last:  # every choice ended: the worker's usage is what was delivered
                            call.usage = usage
                    item = await anext(events, None)
            except APIError as exc:  # after the headers went out: report in the stream, as OpenAI does
                call.outcome = call.outcome or OUTCOME_SERVER_ERROR
                await out.write(writer.error(exc.to_json(call.request_id)))
            await settle_worker_tokens(request, call)  # before [DONE]: the client's next request sees it
            await out.write(writer.done())  # a cut here too bills only what left (review r11 #1)
            await out.write_eof()
        except ConnectionResetError:  # the client hung up or stopped reading: recorded, not our error
            call.delivered_tokens = out.delivered()  # not what the abort threw away
            cut_call(request, call)
            return response
        except asyncio.CancelledError:
            if not request.config_dict[DRAIN].started:
                raise  # the client went away
            await _end_for_shutdown(call, response, writer)
            return response
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
    error = Unavailable("the gateway is shutting down; the answer was cut short").to_json(call.request_id)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(response.write(writer.error(error) + writer.done()), 1.0)
        await asyncio.wait_for(response.write_eof(), 1.0)


async def _complete(
    request: web.Request, endpoint: str, parse: Callable[..., Any], formatter: Formatter
) -> web.StreamResponse:
    try:
        async with tenant_call(request, endpoint) as call:
            body = await read_request(request, call.tenant.tenant_id, parse)
            return await _serve(request, call, body, formatter)
    except AnswerCut as cut:  # recorded as the client's cancellation; its connection is gone
        return cut.response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, "chat.completions", parse_chat, openai_format.chat_completion)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, "completions", parse_completion, openai_format.completion)


async def prompt_lint(request: web.Request) -> web.Response:
    """What canonicalization would change in a chat request, and the prompt tokens of reuse it costs.
    Rate-limited and admitted like any tenant call (it counts against ``max_concurrent_requests`` and
    runs in the tenant's share of the CPU pool); bounded by ``max_prompt_chars`` but not by the
    context window (a prompt being shortened can be linted); not billed (no usage record)."""
    tenant = authenticate(request)
    gate = request.config_dict[ADMISSION]
    gate.enter(tenant.tenant_id, tenant.max_concurrent_requests)
    try:
        headers = (await check_rate_limit(request, tenant)).headers("requests")
        parsed = (await read_request(request, tenant.tenant_id, parse_chat)).request
        pipeline = request.config_dict[PIPELINE]
        if request.config_dict[UPSTREAMS].upstream_for(parsed.model) is not None:
            message = (
                f"prompt lint needs the model's tokenizer: '{parsed.model}' is served by an external upstream"
            )
            raise InvalidRequest(message, param="model", code="unsupported_model")
        model = pipeline.resolve_model(parsed.model)
        pipeline.check_prompt_size(parsed, model, context_window=False)
        lint = request.config_dict[CANONICALIZER].lint
        body = await pipeline.run_cpu(lint, tenant, model, parsed, owner=tenant.tenant_id)
    finally:
        gate.leave(tenant.tenant_id, 1)
    if tenant.near_miss_routing:  # where this tenant's similar prompts parted: canonicalization candidates
        body["near_miss_findings"] = await request.config_dict[NEAR_MISS].findings(tenant.tenant_id)
    return openai_format.json_response(body, headers=headers)


def _model_json(model_id: str, max_model_len: int | None) -> dict[str, Any]:
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
    data += [_model_json(model_id, None) for model_id in request.config_dict[UPSTREAMS].model_ids]
    return web.json_response({"object": "list", "data": data})


async def get_model(request: web.Request) -> web.Response:
    authenticate(request)
    model_id = request.match_info["model"]
    if request.config_dict[UPSTREAMS].upstream_for(model_id) is not None:
        return web.json_response(_model_json(model_id, None))  # the upstream knows its context window
    model = request.config_dict[PIPELINE].resolve_model(model_id)
    return web.json_response(_model_json(model.model_id, model.max_model_len))


async def healthz(request: web.Request) -> web.Response:
    pool, cache = request.config_dict[WORKER_POOL], request.config_dict[POLICY_CACHE]
    healthy = sum(state.healthy for state in pool.workers.values())
    external = request.config_dict[UPSTREAMS].model_ids  # not health-checked: their errors map to 5xx
    ready = (healthy > 0 or bool(external)) and cache.ready
    body = {
        "status": "ok" if ready else "starting",
        "workers_healthy": healthy,
        "workers_total": len(pool.workers),
        "policies_loaded": cache.ready,
        "models": sorted([*pool.models, *external]),
    }
    return web.json_response(body, status=200 if ready else 503)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=expect_continue)
    app.router.add_post("/v1/completions", completions, expect_handler=expect_continue)
    app.router.add_post("/v1/prompt-lint", prompt_lint, expect_handler=expect_continue)
    app.router.add_get("/v1/models", list_models, expect_handler=expect_continue)
    app.router.add_get("/v1/models/{model}", get_model, expect_handler=expect_continue)
    app.router.add_get("/healthz", healthz, expect_handler=expect_continue)
