"""Tenant request bodies to parsed requests without holding the event loop.

A small body (up to ``INLINE_BODY_BYTES``) is parsed on the loop: well under a millisecond. A larger
one is parsed in the tenant's share of the CPU pool (``gateway.cpu``): a 3 MB body of a million token
ids took ~0.05 s of JSON and ~0.2 s of checks, and eight of them at once held every other tenant's
requests for up to 2 s. A token-id prompt longer than the context window of the model it names (for a
model not served here: of the largest one served) is refused from its length before any id is checked
(``schemas.parse_completion``), as a 404 ``model_not_found`` when the model is not served here (as
any other request for it is), else a 400 ``context_length_exceeded``; an external upstream's window
is unknown here: its prompts are bounded by ``max_prompt_chars`` and by the upstream.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from gateway.errors import ContextLengthExceeded, ModelNotFound
from gateway.json_body import load_json
from gateway.schemas import ChatRequest, CompletionRequest, parse_completion
from gateway.slow_clients import request_body
from gateway.state import PIPELINE, UPSTREAMS, WORKER_POOL

INLINE_BODY_BYTES = 64 << 10

T = TypeVar("T", ChatRequest, CompletionRequest)


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptBounds:
    """The most prompt tokens per model id served here (None: unknown, an external upstream's)."""

    model_to_max_tokens: Mapping[str, int | None]
    default: int | None  # a model not served here: the largest window served (None: none known)
    known: frozenset[str] | None = None  # every model id served here (None: no worker ready to tell)

    def for_model(self, model: Any) -> int | None:
        if isinstance(model, str) and model in self.model_to_max_tokens:
            return self.model_to_max_tokens[model]
        return self.default

    def is_unknown(self, model: Any) -> bool:
        """True when ``model`` is certainly not served here (``pipeline.resolve_model``'s 404)."""
        return self.known is not None and not (isinstance(model, str) and model in self.known)


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
    pool = app[WORKER_POOL]
    # As resolve_model: while workers exist and none is ready, no model id can be called unknown.
    ready = bool(pool.models) or not pool.workers
    known = frozenset(windows) | frozenset(pool.known_model_ids()) if ready else None
    return PromptBounds(model_to_max_tokens=windows, default=default, known=known)


def parse_body(body: bytes, parse: Callable[..., T], bounds: PromptBounds) -> tuple[dict[str, Any], T]:
    """``body`` loaded and parsed by ``parse`` (``parse_chat`` or ``parse_completion``)."""
    raw = load_json(body)
    if parse is parse_completion:  # only a completion's prompt may be token ids
        model = raw.get("model")
        try:
            return raw, parse(raw, max_prompt_ids=bounds.for_model(model))
        except ContextLengthExceeded:
            if bounds.is_unknown(model):  # the bound was the largest window's: the model comes first
                raise ModelNotFound(f"The model '{model}' does not exist", param="model") from None
            raise
    return raw, parse(raw)


async def read_request(request: web.Request, owner: str, parse: Callable[..., T]) -> ParsedBody:
    """The body of ``request`` (read already by ``slow_clients.read_body_middleware``), parsed: inline
    when small, else on the CPU pool within ``owner``'s share (a tenant id)."""
    body = await request_body(request)
    bounds = prompt_bounds(request)
    if len(body) <= INLINE_BODY_BYTES:
        raw, parsed = parse_body(body, parse, bounds)
    else:
        raw, parsed = await request.config_dict[PIPELINE].run_cpu(
            parse_body, body, parse, bounds, owner=owner
        )
    return ParsedBody(raw=raw, request=parsed)
