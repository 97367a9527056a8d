"""The tokens-per-minute window of a bundled-worker request, corrected once the answer is known.

The check (``tenant_calls.check_token_limit``, before routing) counts prompt + n × max_tokens, as OpenAI
does; the worker usually generates fewer. Once the request ends, its window is corrected to what the
worker did: the prompt (when a worker took the request: not when every worker shed it unstarted or
refused it as invalid, ``refused_unstarted``) plus the completion tokens generated (the worker's usage)
or, for an answer that did not complete, those received from the worker, delivered or not: a stream
cut for not being read used the worker for all it generated, and settling it to what the client took
would let a tenant holding stalled streams generate past its limit (they are counted as the worker's
answer arrives, before the client is written to: ``choices.choice_events``). A non-streamed answer
whose client hung up keeps the check's count: it arrives whole at its end, so nothing of it was seen. A
refund goes back to the
window the check counted in, while it is current (``gateway.ratelimit``); a charge (a request that used
more than it was counted, which the worker's max_tokens should prevent) lands in the current one. As the
upstream path's ``upstream_serve.settle_token_limit``, the correction runs in its own task: a client
hanging up while it runs does not stop it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from gateway.billing import TenantCall
from gateway.errors import APIError
from gateway.ratelimit import tokens_key
from gateway.state import RATE_LIMITER
from gateway.upstream import WorkerNotStarted
from tenancy.usage_types import OUTCOME_CLIENT_CANCELLED

_SETTLING: set[asyncio.Task] = set()  # corrections under way: a reference until each ends


def refused_unstarted(call: TenantCall, error: APIError) -> bool:
    """Whether ``error`` ends a routed request that no worker started: every worker shed it (queue full,
    unreachable: ``WorkerNotStarted``) or refused it as invalid (a 4xx), and none reported a token."""
    started = call.usage is not None or call.prompt_usage is not None
    return (
        call.prepared is not None
        and not started
        and (isinstance(error, WorkerNotStarted) or error.status < 500)
    )


def num_worker_tokens_used(call: TenantCall) -> int | None:
    """Prompt + completion tokens the request took from the workers (0: no worker took it; None: keep
    what the check counted)."""
    if call.prepared is None or call.worker_refused:  # refused before routing, or by every worker
        return 0
    if call.usage is None and not call.prepared.stream and call.outcome == OUTCOME_CLIENT_CANCELLED:
        # A non-streamed answer arrives whole at its end: a client that hung up before it got nothing
        # the gateway could count (one choice), yet the worker generated until the abort. It keeps the
        # check's prompt + n × max_tokens, else hanging up just before the end would generate without
        # limit (review r20 #3).
        return None
    usage = call.usage or call.prompt_usage or {}
    prompt = int(usage.get("prompt_tokens", call.num_prompt_tokens))
    if call.usage:
        completion = int(call.usage.get("completion_tokens", 0))
    else:  # did not complete: what the worker sent, delivered or not (billing counts only the delivered)
        completion = max(call.delivered_tokens, call.generated_tokens)
    return prompt + completion


async def correct_window(request: web.Request, call: TenantCall, counted: int, used: int | None) -> None:
    """Charge or refund the difference between what the check counted and what the request used (None:
    keep the count): a refund goes back to the window the check counted in, a charge to the current one.
    Shared by the bundled-worker and the upstream paths (``upstream_serve.settle_token_limit``)."""
    if used is None or used == counted:
        return
    limiter, key = request.config_dict[RATE_LIMITER], tokens_key(call.tenant.tenant_id)
    if used > counted:
        await limiter.charge(key, used - counted)
    else:
        await limiter.refund(key, counted - used, call.tokens_counted)


async def run_shielded(correction: Coroutine[Any, Any, None]) -> None:
    """``correction`` in its own task: a client hanging up (the handler cancelled) while the window is
    being corrected does not stop the correction (review r13 #2)."""
    task = asyncio.ensure_future(correction)
    _SETTLING.add(task)
    task.add_done_callback(_SETTLING.discard)
    await asyncio.shield(task)


async def settle_worker_tokens(request: web.Request, call: TenantCall) -> None:
    """Correct the window once (later calls do nothing); only for a request whose check counted."""
    counted = call.worker_limit_tokens
    if counted is None or call.tokens_settled or not call.tenant.rate_limit_tpm:
        return
    call.tokens_settled = True
    await run_shielded(correct_window(request, call, counted, num_worker_tokens_used(call)))
