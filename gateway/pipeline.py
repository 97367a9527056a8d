"""The request pipeline: what happens between an authenticated request and the worker.

    parse → prompt-size check → prompt steps (canonicalization) → render chat template → tokenize
          → context-window check → tokens-per-minute check → promoted-prefix length (hot-prefix promotion)
          → namespace segments → route → worker payload
          → generate (non-stream or stream, cancelled when the client goes away)
          → served: counted towards hot-prefix promotion

The prompt-size check runs before any rendering; rendering, canonicalization and tokenizing run on
the bounded ``CpuPool``, off the event loop. A request that a worker did not take (unreachable, or
its queue full: ``WorkerNotStarted``) goes to another healthy worker; one in flight on a worker found
hung or dead ends with 503 at once (``WorkerPool.until_lost``).

Each step is a plain method or a pluggable object: canonicalization is a ``PromptStep``
(``gateway.canonicalization``), hot-prefix promotion a ``PromotionLookup`` (``gateway.promotion``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from tokenizers import Encoding

from gateway.cpu import CpuPool
from gateway.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound, Unavailable
from gateway.kv_index import PrefixIndex
from gateway.model import ModelRuntime, TemplateError
from gateway.near_miss import NearMissRouting
from gateway.prompt_size import check_prompt_size
from gateway.routing import Router, RouteRequest, cache_key_affinity
from gateway.schemas import ChatRequest, CompletionRequest, SamplingParams
from gateway.special_tokens import chat_encoding
from gateway.upstream import WorkerDisconnected, WorkerNotStarted, error_from_event
from gateway.workers import WorkerPool
from policies.hashing import NamespaceSegment, block_hashes, segment_at
from policies.isolation import namespace_segments, tenant_namespace_id
from policies.promotion import BoundaryPrefix
from tenancy.policy import TenantPolicy

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptEdit:
    """What a prompt step made of a chat request."""

    request: ChatRequest
    num_moved: int = 0  # dynamic fragments moved to the trailing note (x-prefixgate-canonicalized)
    num_reported: int = 0  # fragments found but left in place (canonicalization "report")


class PromptStep(Protocol):
    """Rewrites a chat request before rendering (canonicalization)."""

    def apply(self, tenant: TenantPolicy, request: ChatRequest) -> PromptEdit: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class RenderedPrompt:
    """A request's prompt as the worker will see it."""

    request: ChatRequest | CompletionRequest  # after the prompt steps
    text: str | None  # the rendered chat template or the completion prompt (None: client sent token ids)
    token_ids: list[int]
    encoding: Encoding | None = None  # the chat prompt's tokenizer output (character offsets)
    num_moved: int = 0  # summed over the prompt steps
    num_reported: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class PromotionMatch:
    """What hot-prefix promotion makes of one request."""

    promoted_prefix_tokens: int = 0  # block-aligned head hashed in the promoted namespace
    reported_prefix_tokens: int = 0  # what the tenant is told: 0 unless it helped promote that prefix
    prefixes: tuple[BoundaryPrefix, ...] = ()  # the request's boundary prefixes, counted once served


CpuRunner = Callable[..., Awaitable[Any]]  # ``fn, *args`` -> ``fn(*args)`` on the CPU pool


class PromotionLookup(Protocol):
    """Hot-prefix promotion as the pipeline sees it.

    ``match`` gets the rendered prompt so it can find message boundaries (``policies.chat_text``) and
    the boundary prefixes' hashes (``policies.promotion.boundary_prefixes``); it only reads, and runs
    that work (a second render of the whole prompt, a hash per block) through ``run_cpu``, the
    tenant's share of the CPU pool, never on the event loop. ``served``
    counts a request once the worker has served it (never before: a refused request must not count).
    """

    async def match(
        self, tenant: TenantPolicy, model: ModelRuntime, prompt: RenderedPrompt, *, run_cpu: CpuRunner
    ) -> PromotionMatch: ...

    def served(
        self, tenant: TenantPolicy, model: ModelRuntime, match: PromotionMatch, token_ids: Sequence[int]
    ) -> None: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class NoPromotion:
    async def match(
        self, tenant: TenantPolicy, model: ModelRuntime, prompt: RenderedPrompt, *, run_cpu: CpuRunner
    ) -> PromotionMatch:
        return PromotionMatch()

    def served(
        self, tenant: TenantPolicy, model: ModelRuntime, match: PromotionMatch, token_ids: Sequence[int]
    ) -> None:
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class PreparedRequest:
    request_id: str
    endpoint: str  # "chat.completions" | "completions"
    tenant: TenantPolicy
    model: ModelRuntime
    prompt_token_ids: list[int]
    segments: list[NamespaceSegment]
    sampling: SamplingParams  # max_tokens resolved
    stream: bool
    include_usage: bool
    worker_url: str
    route_request: RouteRequest | None = None  # what the router placed (abandon drops a cold placement)
    num_canonicalized: int = 0  # fragments moved (the x-prefixgate-canonicalized header)
    num_reported: int = 0  # fragments found and left in place ("report" mode)
    promoted_prefix_tokens: int = 0  # tokens hashed in the promoted namespace as a promoted hot prefix
    promotion: PromotionMatch = PromotionMatch()  # reported tokens, and what to count once served
    near_miss_exact_tokens: int | None = None  # near-miss route: the exact index's cached tokens there
    prefill_tokens: int = 0  # prompt tokens the worker is expected to compute (not cached there, per index)
    x_request_id: str = ""  # the client-facing request id (gateway.request_id), for the worker's logs
    owner: str = ""  # the tenant's opaque tag: the worker's prefetch lane and budget share (not the data's)

    def near_miss_tokens(self, cached_tokens: int) -> int:
        """Cached tokens a near-miss route found beyond what the exact index predicted (0 otherwise)."""
        return (
            0 if self.near_miss_exact_tokens is None else max(0, cached_tokens - self.near_miss_exact_tokens)
        )

    def worker_payload(self) -> dict[str, Any]:
        s = self.sampling
        return {
            "request_id": self.request_id,
            "prompt_token_ids": self.prompt_token_ids,
            "namespace": [
                {
                    "start_token": seg.start_token,
                    "namespace_id": seg.namespace_id,
                    "key": seg.key.hex(),
                    "reserved_blocks": seg.reserved_blocks,
                }
                for seg in self.segments
            ],
            "sampling": {
                "max_tokens": s.max_tokens,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "top_k": s.top_k,
                "seed": s.seed,
                "stop": list(s.stop),
                "stop_token_ids": [],
                "ignore_eos": s.ignore_eos,
                **sampling_extras(s),
            },
            "stream": self.stream,
            "x_request_id": self.x_request_id,
            "cache": True,
            **({"owner": self.owner} if self.owner else {}),
        }


def sampling_extras(s: SamplingParams) -> dict[str, Any]:
    """Penalties, logit bias and logprobs for the worker; left out at their defaults."""
    extras: dict[str, Any] = {}
    if s.presence_penalty:
        extras["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty:
        extras["frequency_penalty"] = s.frequency_penalty
    if s.logit_bias:
        extras["logit_bias"] = {str(token): bias for token, bias in s.logit_bias}
    if s.logprobs:
        extras["logprobs"] = s.top_logprobs
    if s.grammar is not None:
        extras["grammar"] = s.grammar
    return extras


def new_request_id(endpoint: str) -> str:
    return ("chatcmpl-" if endpoint == "chat.completions" else "cmpl-") + secrets.token_hex(12)


class RequestPipeline:
    def __init__(
        self,
        *,
        pool: WorkerPool,
        router: Router,
        salt: bytes,
        default_max_tokens: int,
        affinity_blocks: int,
        prompt_steps: Sequence[PromptStep] = (),
        promotion: PromotionLookup | None = None,
        cpu: CpuPool | None = None,
        max_prompt_chars: int = 0,
        prefix_index: PrefixIndex | None = None,
        near_miss: NearMissRouting | None = None,
        max_answer_units: int = 0,
    ) -> None:
        self._pool = pool
        self._router = router
        self._salt = salt
        self._default_max_tokens = default_max_tokens
        self._affinity_blocks = affinity_blocks
        self._prompt_steps = tuple(prompt_steps)
        self._promotion = promotion or NoPromotion()
        self._prefix_index = prefix_index
        self._near_miss = near_miss
        self._background: set[asyncio.Task] = set()
        self._cpu = cpu
        self._max_prompt_chars = max_prompt_chars
        self._max_answer_units = max_answer_units

    def resolve_model(self, model_id: str) -> ModelRuntime:
        model = self._pool.model(model_id)
        if model is not None:
            return model
        if not self._pool.models and self._pool.workers:
            raise Unavailable("no worker is ready yet; retry shortly")
        raise ModelNotFound(f"The model '{model_id}' does not exist", param="model")

    def check_prompt_size(
        self, request: ChatRequest | CompletionRequest, model: ModelRuntime, *, context_window: bool = True
    ) -> None:
        """``gateway.prompt_size.check_prompt_size`` with this gateway's ``max_prompt_chars``."""
        limit = self._max_prompt_chars
        check_prompt_size(request, model, max_prompt_chars=limit, context_window=context_window)

    async def run_cpu(self, fn: Callable[..., T], *args: Any, owner: str | None = None) -> T:
        """``fn(*args)`` on the CPU pool (inline when the pipeline has none, as in unit tests), within
        ``owner``'s fair share of it when given (a tenant id: ``CpuPool.run_for``)."""
        if self._cpu is None:
            return fn(*args)
        return await (self._cpu.run(fn, *args) if owner is None else self._cpu.run_for(owner, fn, *args))

    def render(
        self, tenant: TenantPolicy, request: ChatRequest | CompletionRequest, model: ModelRuntime
    ) -> RenderedPrompt:
        """Prompt steps, chat template, tokenizer: the token ids the worker gets."""
        text: str | None
        encoding: Encoding | None = None
        num_moved = num_reported = 0
        if isinstance(request, ChatRequest):
            sent = request
            for step in self._prompt_steps:
                edit = step.apply(tenant, request)
                request, num_moved, num_reported = (
                    edit.request,
                    num_moved + edit.num_moved,
                    num_reported + edit.num_reported,
                )
            try:
                text = model.render_chat(request.messages, request.tools)
            except TemplateError as exc:
                if request is sent:
                    raise InvalidRequest(str(exc), param="messages", code="invalid_value") from exc
                # The rewrite broke the template (the note is one more turn where roles must alternate):
                # the request as sent, its moved fragments counted as reported ("report").
                request, num_moved, num_reported = sent, 0, num_reported + num_moved
                try:
                    text = model.render_chat(request.messages, request.tools)
                except TemplateError as exc:
                    raise InvalidRequest(str(exc), param="messages", code="invalid_value") from exc
            encoding = chat_encoding(model, request.messages, request.tools, text)
            token_ids = encoding.ids
        elif isinstance(request.prompt, str):
            text = request.prompt
            token_ids = model.encode_prompt(text)
        else:
            text = None
            token_ids = list(request.prompt)
            if any(t >= model.vocab_size for t in token_ids):
                raise InvalidRequest("prompt contains token ids outside the vocabulary", param="prompt")
        if not token_ids:
            raise InvalidRequest("the prompt is empty", param="prompt", code="invalid_value")
        return RenderedPrompt(
            request=request,
            text=text,
            token_ids=token_ids,
            encoding=encoding,
            num_moved=num_moved,
            num_reported=num_reported,
        )

    def resolve_sampling(
        self, tenant: TenantPolicy, model: ModelRuntime, sampling: SamplingParams, num_prompt_tokens: int
    ) -> SamplingParams:
        room = model.max_model_len - num_prompt_tokens
        requested = sampling.max_tokens
        if (
            tenant.max_tokens_limit is not None
            and requested is not None
            and requested > tenant.max_tokens_limit
        ):
            raise InvalidRequest(
                f"max_tokens {requested} exceeds this tenant's limit of {tenant.max_tokens_limit}",
                param="max_tokens",
                code="invalid_value",
            )
        if room < 1 or (requested is not None and requested > room):
            asked = num_prompt_tokens + (requested or 1)
            raise ContextLengthExceeded(
                f"This model's maximum context length is {model.max_model_len} tokens. "
                f"However, you requested {asked} tokens ({num_prompt_tokens} in the prompt, "
                f"{requested or 1} for the completion). "
                "Please reduce the length of the prompt or the completion.",
                param="messages",
            )
        if requested is None:
            requested = min(self._default_max_tokens, room, tenant.max_tokens_limit or room)
        return replace(sampling, max_tokens=requested)

    def check_answer_size(self, sampling: SamplingParams, endpoint: str) -> None:
        """A non-streamed answer is built whole in memory: n × max_tokens × (1 + top alternatives) per
        token, at most ``max_answer_units`` (0: no limit); beyond it a 400 that says to stream."""
        per_token = 1 + sampling.top_logprobs if sampling.logprobs else 1
        units = sampling.n * (sampling.max_tokens or 0) * per_token
        if self._max_answer_units and units > self._max_answer_units:
            param = "top_logprobs" if endpoint == "chat.completions" and sampling.logprobs else "logprobs"
            if not sampling.logprobs:
                param = "max_tokens"
            raise InvalidRequest(
                f"this answer would hold up to {units} tokens and alternatives (n × max_tokens × "
                f"(1 + top_logprobs)), more than the {self._max_answer_units} a non-streamed answer may: "
                "stream it (stream: true), or lower n, max_tokens or top_logprobs",
                param=param,
                code="answer_too_large",
            )

    def segments(self, tenant: TenantPolicy, *, promoted_prefix_tokens: int = 0) -> list[NamespaceSegment]:
        """Namespace segments derived server-side from the authenticated tenant (and the promotions
        in force) only."""
        return namespace_segments(
            level=tenant.isolation,
            salt=self._salt,
            tenant_id=tenant.tenant_id,
            epoch=tenant.epoch,
            reserved_blocks=tenant.reserved_blocks,
            promoted_prefix_tokens=promoted_prefix_tokens,
        )

    def owner(self, tenant: TenantPolicy) -> str:
        """The tenant's opaque tag (never its id) that the worker queues prefetches and shares their
        budget by: ``shared`` tenants have one namespace but are each a tenant (docs/worker-api.md)."""
        return tenant_namespace_id(self._salt, tenant.tenant_id)

    def route(
        self,
        model: ModelRuntime,
        token_ids: Sequence[int],
        segments: Sequence[NamespaceSegment],
        prompt_cache_key: str | None,
    ) -> str:
        return self._router.choose(self.route_request(model, token_ids, segments, prompt_cache_key))

    def route_request(
        self,
        model: ModelRuntime,
        token_ids: Sequence[int],
        segments: Sequence[NamespaceSegment],
        prompt_cache_key: str | None,
    ) -> RouteRequest:
        """The router's input: healthy candidates with their cached prefix and load, the affinity key."""
        candidates = self._pool.candidates(model.model_id)
        if not candidates:
            raise Unavailable(f"no healthy worker serves '{model.model_id}'")
        # Hashed even for a single worker: ~0.02 ms, and the measured overhead stays that of a fleet.
        affinity: bytes | None = None
        head_block: bytes | None = None  # its storing on a worker says a prefill of the head finished
        block_size = model.block_size
        num_blocks = min(len(token_ids) // block_size, self._affinity_blocks)
        if self._prefix_index is not None and self._prefix_index.workers:
            # Every full block: the KV-event index matches the longest cached prefix on each worker.
            hashes = block_hashes(token_ids, block_size, model.fingerprint, segments)
            namespace_ids = [segment_at(segments, k * block_size).namespace_id for k in range(len(hashes))]
            candidates = self._prefix_index.annotate(candidates, hashes, namespace_ids)
            if num_blocks:
                affinity = head_block = hashes[num_blocks - 1]
        elif num_blocks:
            head = token_ids[: num_blocks * block_size]
            affinity = block_hashes(head, block_size, model.fingerprint, segments)[-1]
        if prompt_cache_key:
            affinity = cache_key_affinity(segments[-1].key, prompt_cache_key)
        return RouteRequest(
            affinity_key=affinity,
            candidates=candidates,
            num_prompt_tokens=len(token_ids),
            block_size=block_size,
            head_block=head_block,
        )

    async def choose_worker(self, route_request: RouteRequest) -> str:
        """The router's choice; a follower of a prefix being prefilled there waits for it first
        (``KVAwareRouter.choose_and_hold``)."""
        choose_and_hold = getattr(self._router, "choose_and_hold", None)
        if choose_and_hold is None or self._prefix_index is None or route_request.head_block is None:
            return self._router.choose(route_request)
        worker_url, hold_s = choose_and_hold(route_request)
        if hold_s > 0:
            leader_of = getattr(self._router, "leader_of", None)
            leader_id = leader_of(route_request) if leader_of is not None else ""
            await self._prefix_index.wait_stored(worker_url, route_request.head_block, hold_s, leader_id)
        return worker_url

    def abandon(self, route_request: RouteRequest | None) -> None:
        """The request will not compute its prefix where it was placed (refused, failed, cancelled or sent
        elsewhere): drop the cold placement it made, if still its own, and release the followers already
        waiting for it there (``KVAwareRouter.drop_placement``), so no one waits for a prefill nobody runs."""
        drop_placement = getattr(self._router, "drop_placement", None)
        if route_request is None or drop_placement is None:
            return
        url = drop_placement(route_request)
        if url is not None and self._prefix_index is not None and route_request.head_block is not None:
            # Only this leader's followers: another leader may be computing the same block there.
            self._prefix_index.release(url, route_request.head_block, route_request.request_id)

    def prefilled(self, prepared: PreparedRequest) -> None:
        """The request's first token came from its worker, so its prompt's blocks are cached there: if it
        leads a cold placement, its followers go now rather than when the KV event says so
        (``KVAwareRouter.leader_prefilled``; the event lags by the worker's long-poll and the index)."""
        leader_prefilled = getattr(self._router, "leader_prefilled", None)
        route_request = prepared.route_request
        if leader_prefilled is None or route_request is None or route_request.head_block is None:
            return
        if leader_prefilled(route_request, prepared.worker_url) and self._prefix_index is not None:
            self._prefix_index.release(
                prepared.worker_url, route_request.head_block, route_request.request_id, stored=True
            )

    async def prepare(
        self,
        tenant: TenantPolicy,
        request: ChatRequest | CompletionRequest,
        *,
        endpoint: str,
        request_id: str,
        x_request_id: str = "",
        check_tokens: Callable[[int], Awaitable[None]] | None = None,
        arrived_s: float | None = None,
    ) -> PreparedRequest:
        """Everything up to the worker's payload. ``check_tokens(prompt + n × max_tokens)`` (the tokens per
        minute limit) runs before routing: a refused request places no prefix that others would wait for.
        ``arrived_s`` (``time.perf_counter()``): when the request came in; near miss waits for an embedding
        until then + its bound at most (default: from when it consults)."""
        model = self.resolve_model(request.model)
        self.check_prompt_size(request, model)
        prompt: RenderedPrompt = await self.run_cpu(
            self.render, tenant, request, model, owner=tenant.tenant_id
        )
        token_ids = prompt.token_ids
        sampling = self.resolve_sampling(tenant, model, request.sampling, len(token_ids))
        if not request.stream:
            self.check_answer_size(sampling, endpoint)
        if check_tokens is not None:  # each of the n choices may generate max_tokens
            await check_tokens(len(token_ids) + (sampling.max_tokens or 0) * sampling.n)
        run_cpu = functools.partial(self.run_cpu, owner=tenant.tenant_id)
        promotion = await self._promotion.match(tenant, model, prompt, run_cpu=run_cpu)
        promoted = promotion.promoted_prefix_tokens
        segments = self.segments(tenant, promoted_prefix_tokens=promoted)
        route_request = self.route_request(model, token_ids, segments, request.prompt_cache_key)
        route_request = replace(route_request, request_id=request_id)
        worker_url = await self.choose_worker(route_request)
        near_miss_exact_tokens = None
        if self._near_miss is not None and tenant.near_miss_routing:
            try:
                near_miss = await self._near_miss.route(
                    tenant, model, token_ids, segments, route_request, worker_url, arrived_s=arrived_s
                )
            except BaseException:  # cancelled while it waited for an embedding
                self.abandon(route_request)
                raise
            if near_miss.worker_url != worker_url:  # the prefix is computed there, not where it was placed
                self.abandon(route_request)
            worker_url, near_miss_exact_tokens = near_miss.worker_url, near_miss.exact_tokens
        cached_blocks = next((w.cached_blocks for w in route_request.candidates if w.url == worker_url), 0)
        return PreparedRequest(
            request_id=request_id,
            endpoint=endpoint,
            tenant=tenant,
            model=model,
            prompt_token_ids=token_ids,
            segments=segments,
            sampling=sampling,
            stream=request.stream,
            include_usage=request.include_usage,
            worker_url=worker_url,
            route_request=route_request,
            num_canonicalized=prompt.num_moved,
            num_reported=prompt.num_reported,
            promoted_prefix_tokens=promoted if len(segments) > 1 else 0,
            promotion=promotion,
            near_miss_exact_tokens=near_miss_exact_tokens,
            prefill_tokens=max(1, len(token_ids) - cached_blocks * model.block_size),
            x_request_id=x_request_id,
            owner=self.owner(tenant),
        )

    def served(self, prepared: PreparedRequest) -> None:
        """The worker served ``prepared``: count it towards hot-prefix promotion (in the background)."""
        self._promotion.served(prepared.tenant, prepared.model, prepared.promotion, prepared.prompt_token_ids)

    def _abort_later(self, prepared: PreparedRequest) -> None:
        """Tell the worker to drop a request whose client went away (closing the connection also does)."""
        task = asyncio.get_running_loop().create_task(
            self._pool.client(prepared.worker_url).abort(prepared.request_id)
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _retry(
        self, prepared: PreparedRequest, error: WorkerNotStarted | WorkerDisconnected, tried: set[str]
    ) -> PreparedRequest:
        """The request on another healthy worker, or raise ``error``. A connection broken before the
        worker answered is retried once, and only when the worker is dead (it never got the request, or
        died with it; one retry bounds the harm of a request that kills workers)."""
        state = self._pool.workers[prepared.worker_url]
        if isinstance(error, WorkerDisconnected) and (len(tried) > 1 or not await state.client.is_dead()):
            raise error
        self.abandon(prepared.route_request)  # its prefix will not be computed where it was placed
        if error.code in ("worker_unreachable", "worker_disconnected"):  # dead: stop routing there
            state.mark_lost(error.message, end_requests=False)  # its other requests retry by themselves
        candidates = [c for c in self._pool.candidates(prepared.model.model_id) if c.url not in tried]
        if not candidates:
            raise error
        url = self._router.choose(RouteRequest(affinity_key=None, candidates=candidates))
        log.info("request %s: %s (%s); sent to %s", prepared.request_id, error.message, state.url, url)
        return replace(prepared, worker_url=url)

    async def generate(self, prepared: PreparedRequest) -> dict[str, Any]:
        tried: set[str] = set()
        while True:
            tried.add(prepared.worker_url)
            state = self._pool.workers[prepared.worker_url]
            state.in_flight += 1
            state.pending_prefill_tokens += prepared.prefill_tokens  # until the answer: no first token here
            try:
                call = state.client.generate(prepared.worker_payload())
                answer = await self._pool.until_lost(state, call, prepared.request_id)
                self.prefilled(prepared)
                return answer
            except (WorkerNotStarted, WorkerDisconnected) as exc:
                prepared = await self._retry(prepared, exc, tried)
            except asyncio.CancelledError:
                self._abort_later(prepared)
                raise
            finally:
                state.in_flight -= 1
                state.pending_prefill_tokens -= prepared.prefill_tokens

    async def stream(self, prepared: PreparedRequest) -> AsyncIterator[dict[str, Any]]:
        """The worker's events; raises on an error event. Closing it early aborts the worker request."""
        tried: set[str] = set()
        while True:
            tried.add(prepared.worker_url)
            state = self._pool.workers[prepared.worker_url]
            state.in_flight += 1
            prefilling = prepared.prefill_tokens  # pending on the worker until its first event
            state.pending_prefill_tokens += prefilling
            finished = False
            try:
                worker_events = state.client.generate_stream(prepared.worker_payload())
                async with contextlib.aclosing(worker_events) as events:
                    try:
                        event = await self._pool.until_lost(state, anext(events, None), prepared.request_id)
                    except (WorkerNotStarted, WorkerDisconnected) as exc:
                        finished = True  # nothing to abort there
                        prepared = await self._retry(prepared, exc, tried)
                        continue
                    state.pending_prefill_tokens -= prefilling
                    prefilling = 0
                    if event is not None and event.get("type") != "error":
                        self.prefilled(prepared)
                    while event is not None:
                        kind = event.get("type")
                        if kind == "error":
                            finished = True
                            raise error_from_event(event)
                        if kind == "final":
                            finished = True
                        yield event
                        event = await self._pool.until_lost(state, anext(events, None), prepared.request_id)
                    return
            finally:
                state.in_flight -= 1
                state.pending_prefill_tokens -= prefilling
                if not finished:
                    self._abort_later(prepared)

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=2)
