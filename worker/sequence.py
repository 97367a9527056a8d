"""A request's state inside the engine."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from policies.hashing import BlockHash, NamespaceSegment
from worker.tokenizer import IncrementalDetokenizer


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # subtracted once from each token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence of a token already generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits
    logprobs: int | None = None  # report each token's logprob and this many alternatives (None: off)
    grammar: Mapping[str, Any] | None = None  # constrained decoding (worker.structured), None: free text


class Status(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # admitted; its cached blocks are being copied into the device pool
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass(slots=True)
class Timings:
    arrival_s: float
    admitted_s: float | None = None  # first time the scheduler gave it blocks
    first_token_s: float | None = None
    finished_s: float | None = None


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    segments: tuple[NamespaceSegment, ...]  # namespace segments of the prompt (DESIGN "Prefix identity")
    use_cache: bool  # reuse and publish cached blocks
    detokenizer: IncrementalDetokenizer
    timings: Timings
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)  # hashes of the full blocks known so far
    num_computed_tokens: int = 0  # tokens whose KV is in the block table
    num_prefill_tokens: int = 0  # tokens to compute before decoding starts (set on admission)
    num_cached_tokens: int = 0  # prompt tokens reused from the cache on (first) admission
    cached_tokens_by_source: dict[str, int] = field(default_factory=dict)
    num_published_blocks: int = 0  # leading blocks already offered to the prefix cache
    emitted_text_len: int = 0  # characters of detokenizer.text already sent to the client
    finish_reason: str | None = None
    num_preemptions: int = 0
    prefetching: bool = False  # lower tiers are fetching its blocks into host memory
    prefetched: Any = None  # blocks fetched from disk or Redis for it (worker.tiers.store.PrefetchResult)
    staged_bytes: int = 0  # of the store's prefetch budget, held by ``prefetched``
    block_origins: dict[BlockHash, str] = field(default_factory=dict)  # prefetched block -> tier it came from
    transfers: list[Any] = field(default_factory=list)  # copies into the device pool in flight
    loading_slots: list[int] = field(default_factory=list)  # L2 slots pinned while ``transfers`` run
    matcher: Any = None  # llguidance.LLMatcher of ``sampling.grammar`` (engine thread only)
    grammar_complete: bool = False  # the grammar allows nothing more: the request stops
    in_waiting_queue: bool = False  # counted in the engine's bounded waiting queue (not admitted yet)
    purge_tag: int = 0  # worker.purge_fence tag at arrival: blocks of a namespace purged since are dropped
    owner: str = ""  # the tenant tag the gateway names (``shared`` tenants share a namespace, not a tag)
    prefetch_resume_at: int | None = None  # first block its prefetch left for want of budget: planned again

    @property
    def namespace_id(self) -> str:
        """Owner of the sequence's private tail (its last segment)."""
        return self.segments[-1].namespace_id

    @property
    def tenant_tag(self) -> str:
        """Whose request this is, for fairness between tenants (prefetch lanes and budget shares): the
        owner the gateway named, else the namespace of the private tail."""
        return self.owner or self.namespace_id

    def token_at(self, index: int) -> int:
        """Token ``index`` of prompt + output, without building the joined list."""
        prompt = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < prompt else self.output_token_ids[index - prompt]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens ``start … end-1`` of prompt + output, copying only that span."""
        prompt = len(self.prompt_token_ids)
        if end <= prompt:
            return self.prompt_token_ids[start:end]
        head = self.prompt_token_ids[start:prompt]
        return head + self.output_token_ids[max(0, start - prompt) : end - prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
