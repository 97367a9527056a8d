"""Which OpenAI request parameters prefixgate honours and which it rejects (no silent ignores).

Every parameter of the OpenAI chat and completions APIs is listed here once. A parameter is either
``honoured`` (it changes the answer as OpenAI documents) or answered with a 400 naming it for the values
that would otherwise be ignored. ``docs/api.md``'s compatibility matrix is generated from this table by
``tests/gateway/test_gateway_compat_matrix.py``, which also sends every row through the real openai SDK.
Fields not listed here are unknown: they are ignored and logged once per field name (``UnknownFields``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

CHAT = "chat"
COMPLETIONS = "completions"
BOTH = frozenset({CHAT, COMPLETIONS})


@dataclass(frozen=True, kw_only=True, slots=True)
class Parameter:
    name: str
    endpoints: frozenset[str]
    honoured: str  # the values honoured ("" when none)
    rejected: str  # the values answered with a 400 naming the parameter ("" when none)


def _p(name: str, endpoints: Iterable[str], honoured: str, rejected: str = "") -> Parameter:
    return Parameter(name=name, endpoints=frozenset(endpoints), honoured=honoured, rejected=rejected)


PARAMETERS: tuple[Parameter, ...] = (
    _p("model", BOTH, "any served model id (404 `model_not_found` otherwise)"),
    _p(
        "messages",
        {CHAT},
        "text content (string or text parts); roles system/developer/user/assistant/tool",
        "non-text content parts",
    ),
    _p("prompt", {COMPLETIONS}, "a string, token ids, or a batch of one", "batches of more than one prompt"),
    _p("max_tokens", BOTH, "yes (capped by the context window and the tenant's limit)"),
    _p("max_completion_tokens", {CHAT}, "yes (same as max_tokens)"),
    _p("temperature", BOTH, "0 to 2"),
    _p("top_p", BOTH, "0 to 1 (0: the most likely token, sent on as 1e-9)"),
    _p("top_k", BOTH, "yes (extension, as vLLM)"),
    _p("seed", BOTH, "yes: same seed, same tokens"),
    _p("stop", BOTH, "up to 4 strings"),
    _p(
        "n",
        BOTH,
        "1 to 8 (each choice is a separate generation sharing the cached prefix; counts `n` requests)",
    ),
    _p("stream", BOTH, "yes (server-sent events)"),
    _p("stream_options", BOTH, "`include_usage`"),
    _p("presence_penalty", BOTH, "-2 to 2 (over the generated tokens)"),
    _p("frequency_penalty", BOTH, "-2 to 2 (over the generated tokens)"),
    _p("logit_bias", BOTH, "token id → -100 to 100"),
    _p("logprobs", BOTH, "chat: true/false; completions: 0 to 5"),
    _p("top_logprobs", {CHAT}, "0 to 20 (with `logprobs: true`)"),
    _p("user", BOTH, "accepted (a string; not used for routing or billing)"),
    _p("safety_identifier", {CHAT}, "accepted (a string, as `user`)"),
    _p("prompt_cache_key", BOTH, "routes requests with the same key to the same worker (within the tenant)"),
    _p("ignore_eos", BOTH, "yes (extension, as vLLM)"),
    _p(
        "tools",
        {CHAT},
        "rendered by the chat template; calls (Hermes/Qwen, Llama-3 JSON) parsed into `tool_calls`; "
        "`function.strict: true` as in `response_format`",
        "models whose chat template has no tools support; under `function.strict: true`, a schema "
        "OpenAI's strict mode refuses",
    ),
    _p(
        "tool_choice",
        {CHAT},
        "`auto`, `none` (not parsed); `required` and a named function enforced by constrained decoding; "
        "`auto` with a strict function: text or calls, a call constrained once it starts",
        "a function that is not in `tools`",
    ),
    _p(
        "parallel_tool_calls",
        {CHAT},
        "`true`; `false`: one call at most (a strict `auto` grammar allows one; else the first is kept)",
    ),
    _p(
        "response_format",
        {CHAT},
        "`text`; `json_object` and `json_schema` by constrained decoding (the answer parses and fits); "
        "`strict: true` as OpenAI's strict mode",
        "a schema that does not compile; under `strict: true`, a schema OpenAI's strict mode refuses (a "
        "property not in `required`, no `additionalProperties: false`, a root that is not an object)",
    ),
    _p("metadata", {CHAT}, "accepted (an object; informational, as OpenAI without `store`)"),
    _p("store", {CHAT}, "`false`", "`true` (completions are never stored)"),
    _p("service_tier", {CHAT}, "`auto`, `default`", "other tiers"),
    _p("modalities", {CHAT}, '`["text"]`', "audio"),
    _p("audio", {CHAT}, "", "any value"),
    _p("prediction", {CHAT}, "", "any value"),
    _p("web_search_options", {CHAT}, "", "any value"),
    _p("reasoning_effort", {CHAT}, "", "any value (no reasoning models)"),
    _p("verbosity", {CHAT}, "", "any value"),
    _p("functions", {CHAT}, "", "any value (deprecated: use `tools`)"),
    _p("function_call", {CHAT}, "", "any value (deprecated: use `tool_choice`)"),
    _p("echo", {COMPLETIONS}, "`false`", "`true`"),
    _p("suffix", {COMPLETIONS}, "", "any value"),
    _p("best_of", {COMPLETIONS}, "1, or equal to `n`", "more than `n`"),
)


def known_names(endpoint: str) -> frozenset[str]:
    return frozenset(p.name for p in PARAMETERS if endpoint in p.endpoints)


@dataclass(slots=True)
class UnknownFields:
    """Logs each unknown request field once per process (clients repeat them on every request)."""

    seen: set[tuple[str, str]] = field(default_factory=set)
    max_names: int = 1000  # a client inventing names must not grow this without bound

    def report(self, endpoint: str, names: Iterable[str]) -> list[str]:
        """Log the names not seen before on ``endpoint``; returns them."""
        new = [name for name in names if (endpoint, name) not in self.seen]
        for name in new:
            if len(self.seen) >= self.max_names:
                break
            self.seen.add((endpoint, name))
            log.warning("ignoring unknown field %r in %s requests (logged once)", name[:64], endpoint)
        return new
