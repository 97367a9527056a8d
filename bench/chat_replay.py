"""Chat requests to block ids the way the gateway derives them, for the hit-rate simulator.

Every step is the project's own code, in the gateway's order (docs/canonicalization.md, "Gateway
wiring"):

1. ``prepare``: ``canonicalize_request`` in the setting's mode; the chat template (the built-in
   byte-level one, compiled like the gateway's) renders messages and tools, once plain and once with
   boundary markers; the byte-level tokenizer (one token per byte) gives token ids and offsets;
   ``message_boundary_positions`` → ``locate_markers`` → ``char_to_token_offsets``.
2. ``promote``: for tenants with ``hot_prefix_access``, ``boundary_prefixes`` and
   ``longest_promoted_prefix`` give the request's promoted tokens, then ``observe`` counts it on an
   ``InMemoryPromotionCounter`` (sliding window over the trace's own timestamps) and records the
   promotions it triggers; a promotion serves the requests after the one that triggered it.
3. ``hash_requests``: ``namespace_segments`` (with the promoted tokens) and ``block_hashes``; equal
   block hashes get equal integer ids, which the cache replay (``bench.replay``) consumes.

The replay is deterministic: the namespace salt and model fingerprint are fixed constants.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.chat_workload import ChatRequest
from bench.isolation import Partition, split_capacity
from bench.replay import ReplayRequest
from gateway.model import compile_chat_template
from policies.canonicalize import CanonicalizationPolicy, canonicalize_request
from policies.chat_text import (
    char_to_token_offsets,
    insert_markers,
    locate_markers,
    message_boundary_positions,
)
from policies.eviction import BlockId
from policies.hashing import block_hashes
from policies.isolation import ISOLATION_LEVELS, namespace_segments, tenant_namespace_id
from policies.promotion import (
    InMemoryPromotionCounter,
    PrefixHash,
    PromotedPrefix,
    PromotionPolicy,
    SlidingWindowCounter,
    TenantTag,
    boundary_prefixes,
    hot_prefix_access,
    longest_promoted_prefix,
    observe,
)
from worker.tokenizer import BYTE_CHAT_TEMPLATE, TokenizerBundle

SALT = b"bench/chat-replay salt"
MODEL_FINGERPRINT = b"bench/chat-replay byte-level model"


@dataclass(frozen=True, kw_only=True, slots=True)
class PreparedRequest:
    """A request after canonicalization, rendering and tokenizing: what promotion and hashing need."""

    now_s: float  # arrival time in the trace
    tenant: str
    token_ids: np.ndarray  # uint32 (a 4,000-request workload holds millions of tokens)
    boundary_token_offsets: tuple[int | None, ...]  # message boundaries, in tokens
    num_moved: int  # fragments canonicalization moved into the note
    public: bool  # the system prompt is a public template
    timestamped: bool  # the client put the current time into the system prompt


@dataclass(frozen=True, kw_only=True, slots=True)
class PromotionSettings:
    """Hot-prefix promotion as the replay runs it."""

    policy: PromotionPolicy
    window_s: float  # the counters' sliding window, over trace time
    bucket_s: float
    opted_in: frozenset[str]  # tenants with ``share_hot_prefixes`` set


@dataclass(frozen=True, kw_only=True, slots=True)
class PromotionRun:
    """What promotion did over one replay."""

    promoted_tokens: tuple[int, ...]  # per request: its promoted prefix (0: none), as it was served
    promotions: tuple[PromotedPrefix, ...]  # in promotion order
    senders: dict[PrefixHash, frozenset[str]]  # promoted prefix -> every tenant whose prompt held it

    @property
    def num_promoted_requests(self) -> int:
        return sum(1 for tokens in self.promoted_tokens if tokens)


class ChatRenderer:
    """The built-in model's chat template and tokenizer, as the gateway uses them."""

    def __init__(self) -> None:
        bundle = TokenizerBundle.byte_level()
        self._template = compile_chat_template(BYTE_CHAT_TEMPLATE)
        self._tokenizer = bundle.tokenizer
        self._bos_token = bundle.bos_token or ""

    def render(self, messages: Sequence[dict], tools: list | None) -> str:
        return self._template.render(
            messages=messages, tools=tools or None, add_generation_prompt=True, bos_token=self._bos_token
        )

    def encode(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids and the start character of each token."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, [start for start, _ in encoding.offsets]


def prepare(
    requests: Sequence[ChatRequest], canon_mode: str, renderer: ChatRenderer | None = None
) -> list[PreparedRequest]:
    """Canonicalize (``off``, ``report`` or ``on``), render and tokenize every request."""
    renderer = renderer or ChatRenderer()
    policy = CanonicalizationPolicy(mode=canon_mode)
    prepared = []
    for request in requests:
        body = {"messages": request.messages}
        if request.tools:
            body["tools"] = request.tools
        canon = canonicalize_request(body, policy)
        messages, tools = canon.request["messages"], canon.request.get("tools")
        positions = message_boundary_positions(messages)
        plain = renderer.render(messages, tools)
        chars = locate_markers(
            renderer.render(insert_markers(messages, positions), tools), plain, len(positions)
        )
        token_ids, starts = renderer.encode(plain)
        prepared.append(
            PreparedRequest(
                now_s=request.timestamp_ms / 1000.0,
                tenant=request.tenant,
                token_ids=np.asarray(token_ids, dtype=np.uint32),
                boundary_token_offsets=tuple(char_to_token_offsets(starts, chars or [])),
                num_moved=canon.report.num_moved,
                public=request.public,
                timestamped=request.timestamped,
            )
        )
    return prepared


def promote(
    prepared: Sequence[PreparedRequest], isolation: str, settings: PromotionSettings, *, block_size: int
) -> PromotionRun:
    """Run hot-prefix promotion over the stream, as one gateway would (see the module docstring)."""
    return asyncio.run(_promote(prepared, isolation, settings, block_size))


async def _promote(
    prepared: Sequence[PreparedRequest], isolation: str, settings: PromotionSettings, block_size: int
) -> PromotionRun:
    counter = InMemoryPromotionCounter()
    # Set after construction: InMemoryPromotionCounter(window) keeps ``window or SlidingWindowCounter()``,
    # and an empty SlidingWindowCounter is falsy (it has __len__), so a window passed in is replaced by
    # the default one-hour window.
    counter.window = SlidingWindowCounter(window_s=settings.window_s, bucket_s=settings.bucket_s)
    promoted: dict[PrefixHash, PromotedPrefix] = {}
    senders: dict[PrefixHash, set[str]] = {}  # the simulator's own bookkeeping, for checks
    tags = {tenant: TenantTag(tenant_namespace_id(SALT, tenant)) for tenant in {r.tenant for r in prepared}}
    promoted_tokens = []
    for request in prepared:
        if not hot_prefix_access(isolation, request.tenant in settings.opted_in):
            promoted_tokens.append(0)
            continue
        prefixes = boundary_prefixes(
            request.token_ids,
            request.boundary_token_offsets,
            block_size=block_size,
            model_fingerprint=MODEL_FINGERPRINT,
        )
        promoted_tokens.append(longest_promoted_prefix(prefixes, promoted))
        for prefix in prefixes:
            senders.setdefault(prefix.prefix_hash, set()).add(request.tenant)
        now = request.now_s
        for record in await observe(
            counter, settings.policy, prefixes, tags[request.tenant], now, known=promoted
        ):
            promoted[record.prefix_hash] = record
    return PromotionRun(
        promoted_tokens=tuple(promoted_tokens),
        promotions=tuple(promoted.values()),
        senders={h: frozenset(senders[h]) for h in promoted},
    )


def hash_requests(
    prepared: Sequence[PreparedRequest],
    isolation: str,
    *,
    block_size: int,
    promoted_tokens: Sequence[int] | None = None,
) -> list[ReplayRequest]:
    """The requests as the cache sees them: chained block hashes in their namespaces, as integer ids.

    ``namespace_id`` is ``""`` under ``shared`` and the tenant's namespace tag otherwise (the owner of
    a ``dedicated`` partition).
    """
    if isolation not in ISOLATION_LEVELS:
        raise ValueError(f"unknown isolation {isolation!r}; known: {', '.join(ISOLATION_LEVELS)}")
    ids: dict[bytes, BlockId] = {}
    stream = []
    for index, request in enumerate(prepared):
        segments = namespace_segments(
            level=isolation,
            salt=SALT,
            tenant_id=request.tenant,
            epoch=0,
            promoted_prefix_tokens=promoted_tokens[index] if promoted_tokens else 0,
        )
        hashes = block_hashes(request.token_ids, block_size, MODEL_FINGERPRINT, segments)
        stream.append(
            ReplayRequest(
                now_s=request.now_s,
                block_ids=tuple(ids.setdefault(h, BlockId(len(ids))) for h in hashes),
                namespace_id="" if isolation == "shared" else segments[-1].namespace_id,
            )
        )
    return stream


def hashed_partitions(
    requests: Sequence[ReplayRequest], isolation: str, capacity_blocks: int
) -> list[Partition]:
    """The caches that serve already-namespaced requests: one common pool, or under ``dedicated`` one
    quota per tenant proportional to its requested blocks (as ``bench.isolation.partitions``)."""
    if not ISOLATION_LEVELS[isolation].reserved_capacity:
        return [Partition(requests=tuple(requests), capacity_blocks=capacity_blocks, namespace_id="")]
    by_owner: dict[str, list[ReplayRequest]] = {}
    for request in requests:
        by_owner.setdefault(request.namespace_id, []).append(request)
    demand = {owner: sum(len(r.block_ids) for r in reqs) for owner, reqs in by_owner.items()}
    quotas = split_capacity(capacity_blocks, demand)
    return [
        Partition(requests=tuple(reqs), capacity_blocks=quotas[owner], namespace_id=owner)
        for owner, reqs in sorted(by_owner.items())
    ]
