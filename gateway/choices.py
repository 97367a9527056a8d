"""Model-dependent checks of a request, and its ``n`` choices: ``n`` worker generations sharing the
prompt's cached prefix.

Choice 0 starts first; the others start once it produced its first token, when the prompt's full blocks
are in the worker's prefix cache, so they reuse them instead of prefilling the prompt ``n`` times. All
choices go to the worker the request was routed to (same prefix affinity). A seeded request gives
choice ``i`` the seed ``seed + i``, wrapped modulo 2**64 past the largest 64-bit seed (2**64-1, then 0, 1 …):
reproducible, and the choices differ.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from gateway.errors import InvalidRequest
from gateway.model import ModelRuntime
from gateway.pipeline import PreparedRequest, RequestPipeline
from gateway.schemas import ChatRequest, CompletionRequest

_DONE = object()
SEED_SPAN = 2**64  # seeds are 64-bit: choice seeds past 2**64-1 wrap to 0


def check_model_support(model: ModelRuntime, request: ChatRequest | CompletionRequest) -> None:
    """What only the model can tell: its chat template must render ``tools`` and earlier assistant
    ``tool_calls`` (else they would be dropped silently, and two histories that made different calls
    would be one prompt), and ``logit_bias`` ids must be in its vocabulary."""
    if isinstance(request, ChatRequest) and request.tools and not model.supports_tools:
        raise InvalidRequest(
            f"the chat template of model '{model.model_id}' does not support tools",
            param="tools",
            code="unsupported_parameter",
        )
    if isinstance(request, ChatRequest) and not model.renders_tool_calls:
        for index, message in enumerate(request.messages):
            if message.get("tool_calls"):
                raise InvalidRequest(
                    f"the chat template of model '{model.model_id}' does not render earlier tool calls",
                    param=f"messages[{index}].tool_calls",
                    code="unsupported_parameter",
                )
    vocab = model.vocab_size
    bad = [token for token, _ in request.sampling.logit_bias if token >= vocab]
    if bad:
        raise InvalidRequest(
            f"'logit_bias' token id {bad[0]} is outside the vocabulary (size {vocab})",
            param="logit_bias",
            code="invalid_value",
        )


def choice_requests(prepared: PreparedRequest) -> list[PreparedRequest]:
    """One worker request per choice, each with its own worker request id (and seed)."""
    n = prepared.sampling.n
    if n == 1:
        return [prepared]
    seed = prepared.sampling.seed
    return [
        replace(
            prepared,
            request_id=f"{prepared.request_id}-{i}",
            sampling=replace(prepared.sampling, seed=None if seed is None else _choice_seed(seed, i)),
        )
        for i in range(n)
    ]


def _choice_seed(seed: int, index: int) -> int:
    """``seed + index`` modulo 2**64 (seeds are validated to [-2**63, 2**64)); negative seeds stay as
    they are, since ``seed + index`` of one of them is never past the top."""
    return seed + index - SEED_SPAN if seed + index >= SEED_SPAN else seed + index


def combined_usage(usages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The prompt counts once (as OpenAI bills ``n``), the completions add up; the cache and timing
    breakdown is choice 0's (the one that computed the prompt)."""
    if not usages:
        return {}
    first = dict(usages[0])
    first["completion_tokens"] = sum(int(u.get("completion_tokens", 0)) for u in usages)
    return first


async def choice_events(
    pipeline: RequestPipeline, prepared: PreparedRequest
) -> AsyncIterator[tuple[int, dict]]:
    """``(choice index, worker event)`` of every choice, interleaved as they come; raises the first
    choice error. Closing the iterator early cancels (and so aborts) every choice still running."""
    requests = choice_requests(prepared)
    if len(requests) == 1:
        async with contextlib.aclosing(pipeline.stream(prepared)) as events:
            async for event in events:
                yield 0, event
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    first_token = asyncio.Event()

    async def pump(index: int, request: PreparedRequest) -> None:
        try:
            if index:
                await first_token.wait()
            async with contextlib.aclosing(pipeline.stream(request)) as events:
                async for event in events:
                    first_token.set()
                    await queue.put((index, event))
            await queue.put((index, _DONE))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((index, exc))
        finally:
            first_token.set()  # a failed choice 0 must not leave the others waiting

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def generate_choices(pipeline: RequestPipeline, prepared: PreparedRequest) -> list[dict[str, Any]]:
    """Non-streamed: each choice's worker result (text, token ids, finish reason, usage, logprobs)."""
    if prepared.sampling.n == 1:
        return [await pipeline.generate(prepared)]
    results: list[dict[str, Any]] = [
        {"text": "", "token_ids": [], "logprobs": []} for _ in range(prepared.sampling.n)
    ]
    async with contextlib.aclosing(choice_events(pipeline, prepared)) as events:
        async for index, event in events:
            result = results[index]
            result["text"] += event.get("text") or ""
            result["token_ids"] += event.get("token_ids") or []
            result["logprobs"] += event.get("logprobs") or []
            if event.get("type") == "final":
                result["finish_reason"] = event.get("finish_reason", "stop")
                result["usage"] = event.get("usage") or {}
    return results
