"""Serving a tenant request from an external OpenAI-compatible upstream (``gateway.upstream_openai``).

    authenticate (tenant_call) → prompt-size check → canonicalize (chat) → tenant max_tokens limit
        → namespace key → isolation field + affinity route → token limit (estimated) → forward
        → answer / SSE relay with our id and model → usage from the upstream's ``usage``
        → token limit corrected with that usage (``settle_token_limit``)

What the bundled path does with token ids (context window, promotion, KV index) needs the model's
tokenizer, which an external upstream does not share: the upstream checks its own context window
(its 400 is passed on) and counts the tokens (its ``usage``, with
``prompt_tokens_details.cached_tokens``, is what is billed). When it reports no usage the record says
``usage_unreported`` and bills nothing rather than an invented count.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from gateway.billing import TenantCall
from gateway.errors import APIError, InvalidRequest, PayloadTooLarge
from gateway.openai_format import ChunkWriter, json_response, start_event_stream
from gateway.parameters import CHAT, COMPLETIONS, known_names
from gateway.schemas import ChatRequest, CompletionRequest
from gateway.slow_clients import AnswerCut, ClientStream, send_answer
from gateway.state import CANONICALIZER, CONFIG, METRICS, PIPELINE, UPSTREAMS
from gateway.upstream_openai import CLIENT_ISOLATION_FIELDS, OpenAIUpstream, UpstreamRoute, affinity_key
from gateway.worker_tokens import correct_window, run_shielded
from policies.chat_text import iter_texts
from tenancy.usage_types import OUTCOME_CANCELLED_ESTIMATED, OUTCOME_SERVER_ERROR, OUTCOME_USAGE_UNREPORTED

log = logging.getLogger(__name__)

CANONICALIZED_HEADER = "x-prefixgate-canonicalized"
# Not forwarded: they identify the tenant's end users to a third party and change nothing upstream.
PRIVATE_FIELDS = ("user", "safety_identifier", "metadata")
CHARS_PER_TOKEN_ESTIMATE = 4  # the token-per-minute limit's estimate of a prompt no tokenizer has seen


@dataclass(frozen=True, kw_only=True, slots=True)
class ForwardedRequest:
    """A request ready for its upstream: the body as sent and where it goes."""

    request: ChatRequest | CompletionRequest  # after canonicalization
    upstream: OpenAIUpstream
    route: UpstreamRoute
    path: str  # "/chat/completions" | "/completions"
    body: dict[str, Any]
    num_limit_tokens: int  # estimated prompt + n × max_tokens, for the token-per-minute limit
    num_prompt_estimate: int  # characters / 4: billed only when the upstream's own count is lost
    max_completion_tokens: int | None  # n × max_tokens (None: the upstream's default): a usage bound
    num_canonicalized: int = 0


def _num_prompt_chars(request: ChatRequest | CompletionRequest) -> tuple[int, str]:
    if isinstance(request, ChatRequest):
        texts = sum(len(text) for _, _, text in iter_texts(request.messages))
        return texts + (len(orjson.dumps(request.tools)) if request.tools else 0), "messages"
    if isinstance(request.prompt, str):
        return len(request.prompt), "prompt"
    return len(request.prompt) * CHARS_PER_TOKEN_ESTIMATE, "prompt"  # token ids


def _max_tokens(call: TenantCall, request: ChatRequest | CompletionRequest) -> int | None:
    """The request's max_tokens, or the tenant's limit when it gives none (None: the upstream's default)."""
    requested, limit = request.sampling.max_tokens, call.tenant.max_tokens_limit
    if limit is not None and requested is not None and requested > limit:
        raise InvalidRequest(
            f"max_tokens {requested} exceeds this tenant's limit of {limit}",
            param="max_tokens",
            code="invalid_value",
        )
    return requested if requested is not None else limit


def _prompt_head(request: ChatRequest | CompletionRequest, num_bytes: int) -> bytes:
    """The canonical head of the prompt: what prefix affinity hashes (tools first, as rendered)."""
    if isinstance(request, ChatRequest):
        plain = {"tools": request.tools, "messages": request.messages}
        return orjson.dumps(plain, option=orjson.OPT_SORT_KEYS)[:num_bytes]
    if isinstance(request.prompt, str):
        return request.prompt.encode()[:num_bytes]
    return orjson.dumps(request.prompt[: num_bytes // 4])


def _body(
    raw: dict[str, Any],
    request: ChatRequest | CompletionRequest,
    route: UpstreamRoute,
    isolation: dict[str, Any],
    max_tokens: int | None,
) -> dict[str, Any]:
    """What the upstream gets: the known parameters as the client sent them (validated), the
    canonicalized prompt, the upstream's model name and the server-derived isolation field. A
    client's ``cache_salt``/``prompt_cache_key`` and unknown fields are never forwarded."""
    chat = isinstance(request, ChatRequest)
    names = known_names(CHAT if chat else COMPLETIONS)
    body = {
        key: value
        for key, value in raw.items()
        if key in names and key not in CLIENT_ISOLATION_FIELDS and key not in PRIVATE_FIELDS
    }
    body["model"] = route.model
    if body.get("top_p") == 0:  # vLLM and SGLang refuse 0: the same nucleus of one token
        body["top_p"] = request.sampling.top_p
    if isinstance(request, ChatRequest):
        body["messages"] = list(request.messages)
        if request.tools:
            body["tools"] = list(request.tools)
    if max_tokens is not None and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = max_tokens
    if request.stream:
        options = {"include_usage": True}
        if route.upstream.continuous_usage:  # usage on every chunk: a cut stream is billed exactly
            options["continuous_usage_stats"] = True
        body["stream_options"] = options
    else:
        body.pop("stream_options", None)
    return {**body, **isolation}


async def prepare(
    request: web.Request,
    call: TenantCall,
    parsed: ChatRequest | CompletionRequest,
    upstream: OpenAIUpstream,
    raw: dict[str, Any],
) -> ForwardedRequest:
    """Checks, canonicalization, isolation and route of a request for ``upstream``; ``raw`` is its
    body as sent (``parsed`` from it)."""
    app = request.config_dict
    config, pipeline = app[CONFIG], app[PIPELINE]
    num_chars, param = _num_prompt_chars(parsed)
    if config.max_prompt_chars and num_chars > config.max_prompt_chars:
        raise PayloadTooLarge(
            f"the prompt has {num_chars} characters; this gateway accepts at most {config.max_prompt_chars}",
            param=param,
        )
    num_moved = 0
    if isinstance(parsed, ChatRequest):
        edit = await pipeline.run_cpu(
            app[CANONICALIZER].apply, call.tenant, parsed, owner=call.tenant.tenant_id
        )
        parsed, num_moved = edit.request, edit.num_moved
        metrics, tenant_id = app[METRICS], call.tenant.tenant_id
        if edit.num_moved:
            metrics.canonicalization_fragments.of(tenant_id, "moved").inc(edit.num_moved)
        if edit.num_reported:
            metrics.canonicalization_fragments.of(tenant_id, "reported").inc(edit.num_reported)
    max_tokens = _max_tokens(call, parsed)
    namespace_key = pipeline.segments(call.tenant)[-1].key  # the tenant's, server-derived only
    head = _prompt_head(parsed, config.affinity_blocks * 64)
    route = app[UPSTREAMS].route(parsed.model, affinity_key(namespace_key, head, parsed.prompt_cache_key))
    isolation = upstream.isolation_fields(namespace_key, parsed.prompt_cache_key)
    num_prompt_estimate = -(-num_chars // CHARS_PER_TOKEN_ESTIMATE)
    num_new = (max_tokens or config.default_max_tokens) * parsed.sampling.n
    chat = isinstance(parsed, ChatRequest)
    return ForwardedRequest(
        request=parsed,
        upstream=upstream,
        route=route,
        path="/chat/completions" if chat else "/completions",
        body=_body(raw, parsed, route, isolation, max_tokens),
        num_limit_tokens=num_prompt_estimate + num_new,
        num_prompt_estimate=num_prompt_estimate,
        max_completion_tokens=None if max_tokens is None else max_tokens * parsed.sampling.n,
        num_canonicalized=num_moved,
    )


# The largest count a usage record stores (an INTEGER column): anything above is nonsense from upstream.
MAX_REPORTED_TOKENS = 2**31 - 1


def _count(value: Any) -> int | None:
    """A token count as reported (bool is not a count), or None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def billing_usage(usage: Any, *, max_completion_tokens: int | None = None) -> dict[str, Any] | None:
    """The billing form of an upstream's OpenAI ``usage`` (None: it reported none we can read). A
    missing ``cached_tokens`` is 0: no discount that the upstream did not report. Counts that cannot
    be true are clamped and logged: negative ones to 0, ``cached_tokens`` to ``prompt_tokens``,
    ``completion_tokens`` to what the request allowed (``n`` × ``max_tokens``, when known)."""
    if not isinstance(usage, dict) or (prompt := _count(usage.get("prompt_tokens"))) is None:
        return None
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    completion = _count(usage.get("completion_tokens")) or 0
    billed = {
        "prompt_tokens": min(max(prompt, 0), MAX_REPORTED_TOKENS),
        "completion_tokens": min(max(completion, 0), max_completion_tokens or MAX_REPORTED_TOKENS),
        "cached_tokens": max(cached or 0, 0),
        "cached_tokens_reported": cached is not None,
    }
    billed["cached_tokens"] = min(billed["cached_tokens"], billed["prompt_tokens"])
    reported = (prompt, completion, cached or 0)
    if reported != (billed["prompt_tokens"], billed["completion_tokens"], billed["cached_tokens"]):
        log.warning("upstream usage clamped: reported %.300r, billed %s", usage, billed)
    return billed


def client_usage(billed: dict[str, Any], forwarded: ForwardedRequest, call: TenantCall) -> dict[str, Any]:
    """The usage a tenant sees: the upstream's counts, and where they came from."""
    prompt, completion = billed["prompt_tokens"], billed["completion_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": billed["cached_tokens"]},
        "prefixgate": {
            "upstream": forwarded.upstream.name,
            "cached_tokens_reported": billed["cached_tokens_reported"],
            "isolation": call.tenant.isolation,
        },
    }


def num_limit_tokens_used(call: TenantCall, forwarded: ForwardedRequest) -> int | None:
    """What the request counts against the tenant's tokens per minute once the upstream has counted:
    its prompt + n × max_tokens as the check counts them (the completion instead, when it is longer:
    a request without max_tokens may pass the default). For a stream that did not complete, the
    completion is what the upstream generated as far as the gateway received it (its latest usage, or
    one token per chunk choice), delivered or not: a stream cut for not being read used the upstream's
    capacity for all of it. None: the upstream reported nothing and sent no token."""
    if call.usage is not None:
        usage, completion = call.usage, int(call.usage["completion_tokens"])
    else:  # did not complete: what the upstream generated, delivered or not (billing: the delivered)
        usage = call.generated_usage or call.prompt_usage
        if usage is None and call.generated_tokens:
            usage = {"prompt_tokens": forwarded.num_prompt_estimate}
        if usage is None:
            return None
        reported = int(usage.get("completion_tokens", 0))
        completion = max(reported, call.delivered_tokens, call.generated_tokens)
        if forwarded.max_completion_tokens is not None:  # chunks past n × max_tokens: not tokens (r20 #2)
            completion = min(completion, forwarded.max_completion_tokens)
    num_reserved = forwarded.num_limit_tokens - forwarded.num_prompt_estimate
    return int(usage["prompt_tokens"]) + max(num_reserved, completion)


async def settle_token_limit(request: web.Request, call: TenantCall, forwarded: ForwardedRequest) -> None:
    """Correct the tenant's tokens-per-minute window, which the check charged the characters / 4
    estimate, with the tokens the upstream reported (more or fewer): a prompt the estimate undercounts
    (one token a character) must not let a tenant past its limit through an external upstream. A
    refund goes back to the window the check counted in, if it is still current (a stream may end
    minutes later: review r8 #4); a charge lands in the current one (gateway.ratelimit)."""
    if call.tenant.rate_limit_tpm:
        await correct_window(
            request, call, forwarded.num_limit_tokens, num_limit_tokens_used(call, forwarded)
        )


async def _settle_shielded(request: web.Request, call: TenantCall, forwarded: ForwardedRequest) -> None:
    """``settle_token_limit`` in its own task (``worker_tokens.run_shielded``)."""
    await run_shielded(settle_token_limit(request, call, forwarded))


def _headers(call: TenantCall, forwarded: ForwardedRequest) -> dict[str, str]:
    if forwarded.path != "/chat/completions":
        return dict(call.rate_headers)
    return {**call.rate_headers, CANONICALIZED_HEADER: str(forwarded.num_canonicalized)}


async def respond(request: web.Request, call: TenantCall, forwarded: ForwardedRequest) -> web.StreamResponse:
    """Forward the request; the answer (or SSE stream) with our id and the tenant's model id."""
    call.num_prompt_tokens = 0  # unknown until the upstream counts them
    if forwarded.request.stream:
        return await _stream(request, call, forwarded)
    data = await forwarded.upstream.complete(forwarded.route, forwarded.path, forwarded.body, call.request_id)
    billed = billing_usage(data.get("usage"), max_completion_tokens=forwarded.max_completion_tokens)
    call.usage = billed
    if billed is None:
        call.outcome = OUTCOME_USAGE_UNREPORTED
        data.pop("usage", None)  # whatever it was, it is not a usage the client can read
    else:
        data["usage"] = client_usage(billed, forwarded, call)
    await _settle_shielded(request, call, forwarded)
    data.update(id=call.completion_id, model=forwarded.request.model)
    answer = json_response(data, headers=_headers(call, forwarded))
    await send_answer(request, call, answer)
    return answer


def _num_token_choices(choices: list[dict[str, Any]]) -> int:
    """Tokens a chunk carries, counted as one per choice with text (a stream sends a token a chunk)."""
    count = 0
    for choice in choices:
        delta = choice.get("delta")
        delta = delta if isinstance(delta, dict) else {}
        if (
            delta.get("content")
            or delta.get("tool_calls")
            or delta.get("reasoning_content")
            or choice.get("text")
        ):
            count += 1
    return count


class _Relay:
    """Rewrites an upstream stream's chunks and keeps what was delivered for the usage record."""

    def __init__(self, call: TenantCall, forwarded: ForwardedRequest) -> None:
        self._call, self._forwarded = call, forwarded
        self.usage: dict[str, Any] | None = None  # the latest usage the upstream reported
        self.num_relayed = 0  # tokens written to the client, counted by chunk (the estimate's)
        self._num_pending = 0  # tokens of the chunk being written
        self._base: dict[str, Any] = {}
        self.settled = False  # the tokens-per-minute window was corrected (settle_token_limit)

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        """The SSE bytes to send for ``chunk`` (b"" for a usage-only chunk: sent at the end)."""
        bound = self._forwarded.max_completion_tokens
        usage = billing_usage(chunk.pop("usage", None), max_completion_tokens=bound)
        if usage is not None:
            self.usage = self._call.generated_usage = usage  # not rewound by a cut: the window's
        chunk.update(id=self._call.completion_id, model=self._forwarded.request.model)
        self._base = {key: chunk[key] for key in ("id", "object", "created", "model") if key in chunk}
        choices = chunk.get("choices")
        if not choices:
            self._num_pending = 0
            return b""
        self._num_pending = _num_token_choices(choices)
        self._call.generated_tokens += self._num_pending  # received, delivered or not: the window's
        if self._forwarded.request.include_usage:
            chunk["usage"] = None  # as OpenAI: only the last chunk carries it
        return ChunkWriter.sse(chunk)

    def sent(self) -> tuple[int, dict[str, Any] | None]:
        """The last chunk was written: with per-chunk usage (vLLM, SGLang) its tokens count. Returns
        what the client has once it leaves the gateway (``ClientStream.mark``, ``rewind``)."""
        self.num_relayed += self._num_pending
        self._num_pending = 0
        if self.usage is not None:
            self._call.prompt_usage = self.usage
            self._call.delivered_tokens = self.usage["completion_tokens"]
        return self.num_relayed, self.usage

    def rewind(self, state: tuple[int, dict[str, Any] | None]) -> None:
        """Back to what had left the gateway when the client was cut: what was written after it was
        thrown away by the cut's abort, and is not billed."""
        self.num_relayed, self.usage = state
        call = self._call
        call.prompt_usage = self.usage
        call.delivered_tokens = self.usage["completion_tokens"] if self.usage is not None else 0

    def cut(self, num_prompt_tokens: Callable[[], int]) -> None:
        """The client went away. Without any usage from the upstream, what reached the client is
        billed as an estimate: ``num_prompt_tokens()`` and one completion token per relayed chunk's
        choice, under the outcome ``cancelled_estimated``."""
        if self.usage is not None or self.num_relayed == 0:
            return  # exact (per-chunk usage), or nothing delivered: nothing to bill
        call = self._call
        call.prompt_usage = {"prompt_tokens": num_prompt_tokens()}
        call.delivered_tokens = self.num_relayed
        call.outcome = OUTCOME_CANCELLED_ESTIMATED

    def finish(self) -> bytes:
        """The stream ended whole: record the usage; the usage chunk when the client asked for it."""
        call = self._call
        call.usage = self.usage
        if self.usage is None:
            call.outcome = OUTCOME_USAGE_UNREPORTED
            return b""
        if not self._forwarded.request.include_usage:
            return b""
        usage = client_usage(self.usage, self._forwarded, call)
        return ChunkWriter.sse({**self._base, "choices": [], "usage": usage})


def _num_prompt_tokens(request: web.Request, call: TenantCall, forwarded: ForwardedRequest) -> int:
    """The prompt's tokens by this gateway's tokenizer of the upstream's model, when a bundled worker
    serves a model of that name; else the characters / 4 estimate."""
    pipeline = request.config_dict[PIPELINE]
    with contextlib.suppress(Exception):  # no such model here, or it cannot render this prompt
        model = pipeline.resolve_model(forwarded.route.model)
        return len(pipeline.render(call.tenant, forwarded.request, model).token_ids)
    return forwarded.num_prompt_estimate


async def _relay_all(
    request: web.Request,
    call: TenantCall,
    forwarded: ForwardedRequest,
    relay: _Relay,
    out: ClientStream[tuple[int, dict[str, Any] | None]],
    chunk: dict[str, Any] | None,
    events: AsyncIterator[dict[str, Any]],
) -> None:
    """Every write after the headers: the chunks, then the usage chunk (or an error event), [DONE] and
    the end. The tokens-per-minute window is settled once, before the client sees the end."""
    try:
        while chunk is not None:
            data = relay.chunk(chunk)
            if data:
                await out.write(data)
            out.mark(relay.sent())
            chunk = await anext(events, None)
    except APIError as exc:
        call.outcome = OUTCOME_SERVER_ERROR
        relay.settled = True
        await _settle_shielded(request, call, forwarded)  # the usage of the chunks relayed, if any
        await out.write(ChunkWriter.error(exc.to_json(call.request_id)))
    else:
        final = relay.finish()
        relay.settled = True
        await _settle_shielded(request, call, forwarded)  # before the client sees the end
        if final:
            await out.write(final)
    await out.write(ChunkWriter.done())
    await out.write_eof()


async def _stream(request: web.Request, call: TenantCall, forwarded: ForwardedRequest) -> web.StreamResponse:
    """Relay the upstream's SSE. Errors before the first chunk are HTTP errors; later ones an error
    event (as OpenAI does). A client that goes away cancels the handler, which closes the upstream
    connection (the upstream aborts) and records the call once (``tenant_call``); one cut for not
    reading (``StalledClient``, at any write) ends it with ``AnswerCut``: its response is returned."""
    relay = _Relay(call, forwarded)
    upstream = forwarded.upstream
    chunks = upstream.stream(forwarded.route, forwarded.path, forwarded.body, call.request_id)
    async with contextlib.aclosing(chunks) as events:
        chunk = await anext(events, None)
        ttft = time.perf_counter() - call.started_s
        request.config_dict[METRICS].ttft.labels(call.endpoint).observe(ttft)
        response = await start_event_stream(request, _headers(call, forwarded))
        call.headers_sent = True
        timeout_s = request.config_dict[CONFIG].stream_write_timeout_s
        out = ClientStream[tuple[int, dict[str, Any] | None]](request, response, timeout_s, (0, None))
        try:
            await _relay_all(request, call, forwarded, relay, out, chunk, events)
        except (asyncio.CancelledError, ConnectionResetError) as exc:
            # Wherever it was cut (a chunk, the usage chunk, [DONE], the end): billed what left the
            # gateway, not the whole answer nor what the abort threw away (review r11 #1).
            call.usage = None  # not delivered whole, even when the upstream had finished
            if call.outcome == OUTCOME_USAGE_UNREPORTED:
                call.outcome = None  # the client's cut, as anywhere in the stream (tenant_call)
            relay.rewind(out.delivered())
            relay.cut(lambda: _num_prompt_tokens(request, call, forwarded))
            if not relay.settled:  # its own task: the handler may be cancelled, the correction must land
                await _settle_shielded(request, call, forwarded)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise AnswerCut(response) from exc  # recorded as the client's; no server error logged
    return response
