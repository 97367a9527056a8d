"""What one tenant request did, and the usage record it makes: delivered tokens, who ended it, and the
prices in force when it ran.

Billing rules:
- a request that delivered nothing (refused, failed before its first token, cancelled before any output)
  costs nothing and records 0 tokens;
- a completed request is billed the worker's usage;
- a request cut part-way (client gone, worker crash, gateway shutdown) is billed its prompt as served
  and the completion tokens actually sent to the client: for a stream cut because its client stopped
  reading, the tokens whose bytes left the gateway (not those the cut's abort discarded); a
  non-streamed answer cut while it was written is one piece, billed whole (``bill_whole_answer``);
- an answer the gateway could not format (``format_error``) is billed what was delivered like a cut
  one; when that is nothing, the record still holds the tokens the worker used, at no cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.config import GatewayConfig
from gateway.pipeline import PreparedRequest
from gateway.ratelimit import Counted
from tenancy.policy import TenantPolicy
from tenancy.usage_types import OUTCOME_COMPLETED, OUTCOME_FORMAT_ERROR, Prices, UsageEvent

STATUS_CLIENT_CLOSED = 499  # nginx's convention for "client closed the request" (before any answer)
# The model of a record whose request named no model this gateway serves (or none it could read): a
# client-chosen string would make a report row of its own per name, for free.
UNKNOWN_MODEL = "(unknown)"


@dataclass(slots=True)
class TenantCall:
    """What one tenant request did, for its usage record and metrics."""

    tenant: TenantPolicy
    endpoint: str
    request_id: str  # the x-request-id (the client's or generated): logs, error bodies
    completion_id: str  # the response's "id" and the worker's request id (always server-generated)
    usage_key: str  # the usage record's unique key (gateway.request_id.usage_key): idempotent writes
    key_id: str | None = None
    end_user: str | None = None  # the request's `user` field
    model: str = UNKNOWN_MODEL  # set once the model resolves (a bundled worker's or an upstream's)
    status: int = 200  # HTTP status (a server-cut stream keeps its 200; a client hang-up is 499)
    outcome: str | None = None  # who ended it (tenancy.usage_types.OUTCOMES); None: not decided yet
    headers_sent: bool = False  # a stream's 200 went out
    num_prompt_tokens: int = 0  # known before the worker answers
    usage: dict[str, Any] | None = None  # the worker's final usage, once delivered to the client
    prompt_usage: dict[str, Any] | None = None  # the prompt's usage from a stream's first token
    delivered_tokens: int = 0  # completion tokens whose text was written to the client
    # Completion tokens received from the worker or upstream, delivered or not: what a request that did
    # not complete counts against its tokens per minute (a stalled stream's generation used capacity).
    generated_tokens: int = 0
    generated_usage: dict[str, Any] | None = None  # the latest usage an upstream reported, delivered or not
    prepared: PreparedRequest | None = None  # once the prompt is rendered and routed
    worker_refused: bool = False  # every worker refused it unstarted (queue full, unreachable, invalid)
    rate_headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-* of this request
    requests_counted: Counted | None = None  # where its first unit of requests per minute was counted
    tokens_counted: Counted | None = None  # where its tokens per minute were counted (refunds go there)
    worker_limit_tokens: int | None = (
        None  # a bundled-worker request: the tokens per minute its check counted
    )
    tokens_settled: bool = False  # its window was corrected to what it used (gateway.worker_tokens)
    started_s: float = 0.0  # time.perf_counter() when it arrived (queue time, TTFT)
    admission_slots: int = 0  # held in gateway.admission: 1 once in, n once its n choices are counted

    def bill_whole_answer(self) -> None:
        """A non-streamed answer was cut while it was written (its client stopped taking it, or hung
        up): it is one piece, generated whole and partly sent (the kernel's buffers take its head at
        once, the answer's text), so it is billed whole, as the client's cancellation. Billing only
        an answer taken to its last byte would let a client read all but the tail and pay nothing."""
        if self.usage is not None:
            self.prompt_usage = self.usage
            self.delivered_tokens = int(self.usage.get("completion_tokens", 0))


def tenant_prices(tenant: TenantPolicy, config: GatewayConfig) -> Prices:
    """The tenant's unit prices, or the gateway's defaults where it has none."""

    def pick(value: float | None, default: float) -> float:
        return default if value is None else value

    return Prices(
        input_per_mtok=pick(tenant.price_input_per_mtok, config.price_input_per_mtok),
        cached_input_per_mtok=pick(tenant.price_cached_input_per_mtok, config.price_cached_input_per_mtok),
        output_per_mtok=pick(tenant.price_output_per_mtok, config.price_output_per_mtok),
    )


def usage_event(call: TenantCall, prices: Prices) -> UsageEvent:
    """The record of a finished call (see the billing rules above)."""
    outcome = call.outcome or OUTCOME_COMPLETED
    completed = outcome == OUTCOME_COMPLETED and call.usage is not None
    delivered = call.delivered_tokens
    billed = completed or delivered > 0
    usage = (call.usage if completed else call.prompt_usage) or {}
    # Formatting failed before anything was delivered, yet the worker did the work: keep its counts.
    unbilled_work = not billed and outcome == OUTCOME_FORMAT_ERROR
    if unbilled_work:
        usage = call.usage or call.prompt_usage or {}
    elif not billed:
        usage = {}
    by_tier = {tier: int(n) for tier, n in (usage.get("cached_tokens_by_source") or {}).items()}
    return UsageEvent(
        request_id=call.usage_key,
        tenant_id=call.tenant.tenant_id,
        tenant_name=call.tenant.name,
        key_id=call.key_id,
        end_user=call.end_user,
        model=call.model,
        endpoint=call.endpoint,
        status=call.status,
        outcome=outcome,
        prompt_tokens=int(usage.get("prompt_tokens", call.num_prompt_tokens))
        if billed or unbilled_work
        else 0,
        cached_tokens=int(usage.get("cached_tokens", 0)),
        cached_tokens_by_tier=by_tier,
        completion_tokens=int(usage.get("completion_tokens", delivered))
        if completed or unbilled_work
        else delivered,
        prefill_ms=float(usage.get("prefill_ms", 0.0)),
        saved_prefill_ms=float(usage.get("estimated_saved_prefill_ms", 0.0)),
        prices=prices,
        billable=not unbilled_work,
    )
