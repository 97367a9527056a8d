"""Tenant request bodies to parsed requests without holding the event loop.

A small body (up to ``INLINE_BODY_BYTES``) is parsed on the loop: well under a millisecond. A larger
one is parsed in the tenant's share of the CPU pool (``gateway.cpu``): a 3 MB body of a million token
ids took ~0.05 s of JSON and ~0.2 s of checks, and eight of them at once held every other tenant's
requests for up to 2 s. A token-id prompt longer than the context window of the model it names (for a
model not served here: of the largest one served) is refused from its length before any id is checked
(``schemas.parse_completion``); an external upstream's window is unknown here: its prompts are
bounded by ``max_prompt_chars`` and by the upstream.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from gateway.json_body import load_json
from gateway.schemas import ChatRequest, CompletionRequest, parse_completion
from gateway.state import PIPELINE, UPSTREAMS, WORKER_POOL

INLINE_BODY_BYTES = 64 << 10

T = TypeVar("T", ChatRequest, CompletionRequest)


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptBounds:
    """The most prompt tokens per model id served here (None: unknown, an external upstream's)."""

    model_to_max_tokens: Mapping[str, int | None]
    default: int | None  # a model not served here: the largest window served (None: none known)

    def for_model(self, model: Any) -> int | None:
        if isinstance(model, str) and model in self.model_to_max_tokens:
            return self.model_to_max_tokens[model]
        return self.default


@dataclass(frozen=True, kw_only=True, slots=True)
class ParsedBody:
    """A request body: as sent (an external upstream gets its known fields) and parsed."""

    raw: dict[str, Any]
    request: ChatRequest | CompletionRequest


def prompt_bounds(request: web.Request) -> PromptBounds:
    """The bounds now (a snapshot: read on the loop, used on a thread)."""
    app = request.config_dict
    windows: dict[str, int | None] = {
        model_id: group.runtime.max_model_len for model_id, group in app[WORKER_POOL].models.items()
    }
    default = max((window for window in windows.values() if window), default=None)
    windows.update(dict.fromkeys(app[UPSTREAMS].model_ids))
    return PromptBounds(model_to_max_tokens=windows, default=default)


def parse_body(body: bytes, parse: Callable[..., T], bounds: PromptBounds) -> tuple[dict[str, Any], T]:
    """``body`` loaded and parsed by ``parse`` (``parse_chat`` or ``parse_completion``)."""
    raw = load_json(body)
    if parse is parse_completion:  # only a completion's prompt may be token ids
        return raw, parse(raw, max_prompt_ids=bounds.for_model(raw.get("model")))
    return raw, parse(raw)


async def read_request(request: web.Request, owner: str, parse: Callable[..., T]) -> ParsedBody:
    """The body of ``request`` (read already by ``slow_clients.read_body_middleware``), parsed: inline
    when small, else on the CPU pool within ``owner``'s share (a tenant id)."""
    body = await request.read()
    bounds = prompt_bounds(request)
    if len(body) <= INLINE_BODY_BYTES:
        raw, parsed = parse_body(body, parse, bounds)
    else:
        raw, parsed = await request.config_dict[PIPELINE].run_cpu(
            parse_body, body, parse, bounds, owner=owner
        )
    return ParsedBody(raw=raw, request=parsed)
