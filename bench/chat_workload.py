"""The synthetic multi-tenant workload as chat requests (messages and tools), for replays that need text.

``bench.workloads.plan_workload`` decides who sends what and when; this module writes it out as
OpenAI-style chat requests, so that canonicalization, the chat template, the tokenizer, boundary
prefixes and block hashing run on them exactly as in the gateway:

    system: [the tenant's system prompt or a public template]   (+ the prompt's tools, if it has any)
    user:   Reference document: …                                (if the session attached one)
    user / assistant: earlier turns
    user:   the new message

Text is deterministic per part key (lowercase words, so no fragment rule ever fires on it); a part of
``n`` planned blocks gets ``n`` lines of about ``unit_chars`` characters (with the byte-level
tokenizer, one character is one token). Two client habits that break prefixes are injected:

- **timestamps**: a share of *applications* (a tenant and one of its system prompts or public
  templates, drawn once) put ``Current time: <ISO 8601, to the second>`` after the first line of the
  system prompt, with the request's own time, as apps that tell the model the time do;
- **tool order**: a share of tenants' clients send the prompt's tools in a random order with shuffled
  JSON keys on every request (tools are rendered before the system prompt, so this breaks everything).
"""

from __future__ import annotations

import json
import random
from collections.abc import Hashable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from bench.workloads import Part, PlannedRequest, WorkloadSpec, plan_workload

TRACE_START = datetime(2026, 11, 29, 10, 0, 0, tzinfo=UTC)  # wall-clock time of the trace's t = 0
TIMESTAMP_LINE = "Current time: {now}"
DOCUMENT_HEADER = "Reference document:"
EMPTY_ANSWER = "Done."
_WORDS = (  # noqa: SIM905 (one word list, readable as prose)
    "account address answer apply before billing cancel change check choose client confirm contact "
    "contract customer data delivery describe detail device direct document email ensure error explain "
    "field follow format guide help invoice issue keep limit list manage message note offer order "
    "payment plan please policy price product provide question refund reply report request respond "
    "review rule safe schedule search service share short simple source state status step summary "
    "support system task team ticket tone update user value verify warranty write"
).split()


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatSpec:
    """How planned parts become text."""

    unit_chars: int = 64  # characters (byte-level tokens) per planned block
    timestamp_share: float = 0.0  # share of (tenant, system prompt) applications that send the time
    tools_share: float = 0.5  # share of system prompts and templates that come with tools
    tool_shuffle_share: float = 0.0  # share of tenants whose client shuffles tool order and JSON keys


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatRequest:
    """One request of the chat workload, with what the simulator knows about it."""

    timestamp_ms: float
    tenant: str  # ``t0 … t{n-1}``, as in the block-id trace
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    public: bool  # the system prompt is a public template (shared by tenants)
    timestamped: bool  # a ``Current time`` line was injected

    def to_json(self) -> str:
        record: dict[str, Any] = {"timestamp": self.timestamp_ms, "tenant": self.tenant}
        record["messages"] = self.messages
        if self.tools:
            record["tools"] = self.tools
        return json.dumps(record, separators=(",", ":"))


def chat_workload(spec: WorkloadSpec, chat: ChatSpec) -> list[ChatRequest]:
    """The requests of ``plan_workload(spec)`` as chat requests, in arrival order."""
    texts = _Texts(chat.unit_chars)
    shufflers = {
        tenant
        for tenant in range(spec.num_tenants)
        if _draw(spec.seed, "shuffle", tenant) < chat.tool_shuffle_share
    }
    requests = []
    for index, plan in enumerate(plan_workload(spec)):
        system = plan.parts[0]
        timestamped = _draw(spec.seed, "timestamp", plan.tenant, system.key) < chat.timestamp_share
        now = TRACE_START + timedelta(milliseconds=plan.timestamp_ms)
        tools = _tools(system.key) if _draw(spec.seed, "tools", system.key) < chat.tools_share else None
        if tools and plan.tenant in shufflers:
            tools = _shuffled(tools, random.Random(f"{spec.seed}/order/{index}"))
        requests.append(
            ChatRequest(
                timestamp_ms=plan.timestamp_ms,
                tenant=plan.tenant_name,
                messages=_messages(plan, texts, now if timestamped else None),
                tools=tools,
                public=system.kind == "public",
                timestamped=timestamped,
            )
        )
    return requests


def _messages(plan: PlannedRequest, texts: _Texts, now: datetime | None) -> list[dict[str, Any]]:
    messages = []
    for part in plan.parts:
        if part.kind in ("system", "public"):
            lines = texts.lines(part)
            if now is not None:
                stamp = TIMESTAMP_LINE.format(now=now.strftime("%Y-%m-%dT%H:%M:%SZ"))
                lines = [*lines[:1], stamp, *lines[1:]]
            messages.append({"role": "system", "content": "\n".join(lines)})
        elif part.kind == "document":
            messages.append({"role": "user", "content": "\n".join([DOCUMENT_HEADER, *texts.lines(part)])})
        elif part.kind == "answer":
            messages.append({"role": "assistant", "content": "\n".join(texts.lines(part)) or EMPTY_ANSWER})
        else:
            messages.append({"role": "user", "content": "\n".join(texts.lines(part))})
    return messages


class _Texts:
    """Deterministic text per part key, kept for reuse (a session's history is rendered every turn)."""

    def __init__(self, unit_chars: int) -> None:
        self._unit_chars = unit_chars
        self._lines: dict[tuple[Hashable, ...], list[str]] = {}

    def lines(self, part: Part) -> list[str]:
        lines = self._lines.get(part.key)
        if lines is None:
            rng = random.Random(repr(part.key))
            lines = self._lines[part.key] = [self._line(rng) for _ in range(part.num_blocks)]
        return lines

    def _line(self, rng: random.Random) -> str:
        words: list[str] = []
        length = -1
        while length < self._unit_chars - 2:
            words.append(rng.choice(_WORDS))
            length += len(words[-1]) + 1
        return " ".join(words).capitalize()[: self._unit_chars - 2] + "."


def _tools(key: tuple[Hashable, ...]) -> list[dict[str, Any]]:
    """One to three function tools of a system prompt, in the order its authors wrote them."""
    rng = random.Random(f"tools/{key!r}")
    tools = []
    for _ in range(rng.randint(1, 3)):
        params = rng.sample(_WORDS, rng.randint(1, 4))
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": "_".join(rng.sample(_WORDS, 2)),
                    "description": " ".join(rng.choices(_WORDS, k=12)).capitalize() + ".",
                    "parameters": {
                        "type": "object",
                        "properties": {p: {"type": "string", "description": f"The {p}."} for p in params},
                        "required": params[: rng.randint(1, len(params))],
                    },
                },
            }
        )
    return tools


def _shuffled(value: Any, rng: random.Random) -> Any:
    """The same tools with list order (of tools) and key order (of every object) shuffled."""
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        return {k: _shuffled(value[k], rng) for k in keys}
    if isinstance(value, list) and value and isinstance(value[0], dict):
        items = [_shuffled(v, rng) for v in value]
        rng.shuffle(items)
        return items
    return value


def _draw(seed: int, *what: Hashable) -> float:
    """A uniform number fixed by ``what``: the same application always behaves the same way."""
    return random.Random(f"{seed}/{what!r}").random()
