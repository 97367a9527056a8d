"""Canonicalization: make the cacheable part of a chat request render to the same tokens every time.

Three rules, applied per tenant in one of three modes (``MODES``: ``off``, ``report``, ``on``):

- **Tools**: every tool/function schema is rebuilt with keys in sorted order (``required`` lists
  sorted too) and tools are ordered by type and name, so a template's ``tojson`` renders the same
  tool set identically whatever order the client sent.
- **Dynamic fragments** (``policies.fragments``: timestamps, dates, UUIDs, request/trace ids and the
  tenant's own patterns) found in the *cacheable part* — every message before the last user message —
  are replaced by numbered placeholders ``[[n]]`` and listed, verbatim and in order, in a *note*: one
  message appended after all others, ``[[n]] <value>`` per line under ``NOTE_HEADER``.
- **Whitespace**: in the same texts, ``\\r\\n`` and ``\\r`` become ``\\n`` and spaces/tabs at line ends
  are removed.

Why placeholders and a separate trailing note: a placeholder is constant, so the text around it (and
everything after it) keeps the same tokens from request to request, and numbering lets the model pair
each value with its place. The note goes after *every* message, not into the last user message, so
the user's turn is byte-identical and so an agent loop that appends assistant/tool messages after the
user turn keeps reusing them. Its role is ``user`` by default: moved text never gains authority (a
value from a document cannot become a system instruction). The last user message and everything after
it are never changed. Canonicalization is idempotent: a request that already ends with a note has the
note set aside, its placeholders are never matched again, and new placeholders are numbered after the
highest one the note lists, skipping any placeholder already in the text; past ``MAX_PLACEHOLDER``
(the most ``PLACEHOLDER`` recognises) a value stays in place.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policies.chat_text import (
    MAX_PLACEHOLDER,
    NOTE_HEADER,
    PLACEHOLDER,
    Message,
    cacheable_end,
    iter_texts,
    normalize_whitespace,
    note_entries,
    original_offset,
    set_text,
    split_note,
)
from policies.fragments import (
    BUILTIN_RULES,
    MAX_FRAGMENTS_PER_REQUEST,
    FragmentRule,
    compile_tenant_rules,
    stable_fragments,
)

NOTE_ROLES = ("user", "system", "developer")


@dataclass(frozen=True, kw_only=True, slots=True)
class Mode:
    """What one canonicalization mode does."""

    name: str
    scans: bool  # look for fragments, whitespace and tool-order changes, and report them
    rewrites: bool  # apply them to the request


MODES: Mapping[str, Mode] = {
    "off": Mode(name="off", scans=False, rewrites=False),
    "report": Mode(name="report", scans=True, rewrites=False),
    "on": Mode(name="on", scans=True, rewrites=True),
}
DEFAULT_MODE = "report"


@dataclass(frozen=True, kw_only=True, slots=True)
class CanonicalizationPolicy:
    """A tenant's canonicalization settings, validated once when the tenant policy is loaded."""

    mode: str = DEFAULT_MODE
    rules: tuple[FragmentRule, ...] = tuple(BUILTIN_RULES.values())
    note_role: str = "user"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"canonicalization mode must be one of {sorted(MODES)}, not {self.mode!r}")
        if self.note_role not in NOTE_ROLES:
            raise ValueError(f"note role must be one of {NOTE_ROLES}, not {self.note_role!r}")

    @classmethod
    def from_tenant(
        cls,
        *,
        mode: str = DEFAULT_MODE,
        patterns: Mapping[str, str] | None = None,
        disabled_rules: Iterable[str] = (),
        note_role: str = "user",
    ) -> CanonicalizationPolicy:
        """Build from tenant policy fields; raises ValueError with a clear message on bad input.

        Args:
            mode: ``off``, ``report`` or ``on``.
            patterns: the tenant's extra fragment patterns, name → regular expression.
            disabled_rules: built-in rule names the tenant turned off (false positives in its prompts).
        """
        disabled = set(disabled_rules)
        unknown = disabled - set(BUILTIN_RULES)
        if unknown:
            raise ValueError(f"unknown built-in rules {sorted(unknown)}; known: {sorted(BUILTIN_RULES)}")
        builtin = tuple(rule for name, rule in BUILTIN_RULES.items() if name not in disabled)
        return cls(mode=mode, rules=builtin + compile_tenant_rules(patterns or {}), note_role=note_role)


@dataclass(frozen=True, kw_only=True, slots=True)
class Fragment:
    """A dynamic fragment found in the cacheable part of a request.

    Holds prompt text: return it to the tenant it belongs to, never log it.
    """

    rule: str  # name of the rule that found it
    kind: str
    message_index: int
    part_index: int | None  # index in a content-part list; None for string content
    start: int  # character offsets in the text as the client sent it
    end: int
    text: str
    placeholder: str  # the "[[n]]" it is (or, in report mode, would be) replaced with

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, kw_only=True, slots=True)
class WhitespaceChange:
    """Whitespace normalization of one text."""

    message_index: int
    part_index: int | None
    line_endings: int  # \r\n or \r turned into \n
    trailing_runs: int  # runs of spaces/tabs removed from line ends

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, kw_only=True, slots=True)
class CanonicalizationReport:
    """What canonicalization found and, in ``on`` mode, did."""

    mode: str
    fragments: tuple[Fragment, ...] = ()  # found in this request, in prompt order
    whitespace: tuple[WhitespaceChange, ...] = ()
    tools_changed: bool = False  # tools/functions were (or would be) reordered or re-keyed
    num_moved: int = 0  # fragments moved into the note: the x-prefixgate-canonicalized header
    fragment_limit_reached: bool = False  # MAX_FRAGMENTS_PER_REQUEST found: the rest was not scanned

    @property
    def rules_fired(self) -> tuple[str, ...]:
        return tuple(sorted({f.rule for f in self.fragments}))

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "moved": self.num_moved,
            "fragments": [f.to_json() for f in self.fragments],
            "whitespace": [w.to_json() for w in self.whitespace],
            "tools_changed": self.tools_changed,
            "fragment_limit_reached": self.fragment_limit_reached,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class CanonicalRequest:
    """The request to render, and the report.

    ``request`` is a new dict; fields that canonicalization changed are fresh copies, the others are
    shared with the input (so ``off`` and ``report`` cost no copy). The input is never mutated.
    """

    request: dict[str, Any]
    report: CanonicalizationReport


def canonicalize_request(request: Mapping[str, Any], policy: CanonicalizationPolicy) -> CanonicalRequest:
    """Canonicalize an OpenAI-style chat request (``messages``, ``tools``, legacy ``functions``).

    Other fields pass through unchanged. Pure: no I/O, no clock.
    """
    mode = MODES[policy.mode]
    out = dict(request)
    if not mode.scans:
        return CanonicalRequest(request=out, report=CanonicalizationReport(mode=mode.name))
    messages = request.get("messages")
    messages = messages if isinstance(messages, list) else []
    new_messages, fragments, whitespace = _canonical_messages(messages, policy, rewrite=mode.rewrites)
    tools_changed = False
    for key in ("tools", "functions"):
        value = request.get(key)
        if isinstance(value, list) and value:
            canonical = canonical_tools(value)
            if json.dumps(value, ensure_ascii=False) != json.dumps(canonical, ensure_ascii=False):
                tools_changed = True
                if mode.rewrites:
                    out[key] = canonical
    report = CanonicalizationReport(
        mode=mode.name,
        fragments=fragments,
        whitespace=whitespace,
        tools_changed=tools_changed,
        num_moved=len(fragments) if mode.rewrites else 0,
        fragment_limit_reached=len(fragments) >= MAX_FRAGMENTS_PER_REQUEST,
    )
    if mode.rewrites and (fragments or whitespace):
        out["messages"] = new_messages
    return CanonicalRequest(request=out, report=report)


def _canonical_messages(
    messages: list[Message], policy: CanonicalizationPolicy, *, rewrite: bool
) -> tuple[list[Message], tuple[Fragment, ...], tuple[WhitespaceChange, ...]]:
    """The rewritten messages (only built when ``rewrite``), the fragments and whitespace changes."""
    body, note = split_note(messages)
    end = cacheable_end(body)
    numbers = _placeholder_numbers(messages, note)
    new_messages = copy.deepcopy(body) if rewrite else []
    fragments: list[Fragment] = []
    whitespace: list[WhitespaceChange] = []
    for message_index, part_index, text in iter_texts(body):
        budget = MAX_FRAGMENTS_PER_REQUEST - len(fragments)
        if message_index >= end:
            break
        normalized, line_endings, trailing_runs, deletions = normalize_whitespace(text)
        if line_endings or trailing_runs:
            whitespace.append(
                WhitespaceChange(
                    message_index=message_index,
                    part_index=part_index,
                    line_endings=line_endings,
                    trailing_runs=trailing_runs,
                )
            )
        pieces: list[str] = []
        cursor = 0
        for span in stable_fragments(normalized, policy.rules, limit=budget) if budget > 0 else ():
            placeholder = next(numbers, None)
            if placeholder is None:  # past MAX_PLACEHOLDER: the rest stays in place
                break
            start = original_offset(span.start, deletions)
            fragments.append(
                Fragment(
                    rule=span.rule,
                    kind=span.kind,
                    message_index=message_index,
                    part_index=part_index,
                    start=start,
                    end=start + span.end - span.start,
                    text=normalized[span.start : span.end],
                    placeholder=placeholder,
                )
            )
            pieces += [normalized[cursor : span.start], placeholder]
            cursor = span.end
        pieces.append(normalized[cursor:])
        if rewrite:
            set_text(new_messages[message_index], part_index, "".join(pieces))
    if not rewrite:
        return [], tuple(fragments), tuple(whitespace)
    if fragments:
        entries = "\n".join(f"{f.placeholder} {f.text}" for f in fragments)
        if note is None:
            note = {"role": policy.note_role, "content": f"{NOTE_HEADER}\n{entries}"}
        else:
            note = {**note, "content": f"{note['content']}\n{entries}"}
    if note is not None:
        new_messages.append(copy.deepcopy(note))
    return new_messages, tuple(fragments), tuple(whitespace)


def _placeholder_numbers(messages: Sequence[Message], note: Message | None) -> Iterator[str]:
    """New placeholders, in order: numbered after the highest one the note lists, skipping any that
    already occurs in the text (a literal ``[[7]]`` is kept, never reused), up to ``MAX_PLACEHOLDER``.

    Only the note counts, not literal text: a literal ``[[999999]]`` must not push numbers past what
    ``PLACEHOLDER`` recognises (restore and idempotence would break)."""
    taken = {m.group(0) for _, _, text in iter_texts(messages) for m in PLACEHOLDER.finditer(text)}
    listed = note_entries(note) if note is not None else {}
    start = 1 + max((int(p[2:-2]) for p in listed), default=0)
    return (p for n in range(start, MAX_PLACEHOLDER + 1) if (p := f"[[{n}]]") not in taken)


def restore(messages: Sequence[Message]) -> list[Message]:
    """Put moved fragments back in place and drop the note: the inverse of ``on`` mode up to
    whitespace normalization. For tests and debugging; returns a copy."""
    body, note = split_note(messages)
    body = copy.deepcopy(body)
    if note is None:
        return body
    entries = note_entries(note)
    end = cacheable_end(body)
    for message_index, part_index, text in list(iter_texts(body)):
        if message_index < end:
            restored = PLACEHOLDER.sub(lambda m: entries.get(m.group(0), m.group(0)), text)
            set_text(body[message_index], part_index, restored)
    return body


def canonical_tools(tools: Sequence[Any]) -> list[Any]:
    """Tools (or legacy functions) with sorted keys, sorted ``required`` lists, in a stable order:
    by type, then function name, then canonical JSON. ``required`` is sorted only where it is a
    JSON-Schema keyword (in a function's ``parameters`` and its subschemas), never in data such as a
    ``default``, ``const``, ``enum`` or ``examples`` value, whose order can carry meaning."""
    canonical = [_sorted_value(tool, _TOOL) for tool in tools]
    return sorted(canonical, key=_tool_sort_key)


def canonical_json(value: Any) -> str:
    """The one JSON form of a schema: sorted keys, no spaces, UTF-8 kept as is."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _tool_sort_key(tool: Any) -> tuple[str, str, str]:
    if not isinstance(tool, Mapping):
        return ("", "", canonical_json(tool))
    function = tool.get("function")
    name = function.get("name") if isinstance(function, Mapping) else tool.get("name")
    return (str(tool.get("type", "")), str(name or ""), canonical_json(tool))


_TOOL, _SCHEMA, _SCHEMAS, _SCHEMA_MAP, _DATA = range(5)  # what a value of the walk is
# JSON-Schema keywords whose value is a schema, a list of schemas, or a map of name → schema.
_SCHEMA_KEYWORDS = (
    {
        key: _SCHEMA
        for key in (
            "additionalItems",
            "additionalProperties",
            "contains",
            "else",
            "if",
            "items",
            "not",
            "propertyNames",
            "then",
            "unevaluatedItems",
            "unevaluatedProperties",
        )
    }
    | {key: _SCHEMAS for key in ("allOf", "anyOf", "oneOf", "prefixItems")}
    | {
        key: _SCHEMA_MAP
        for key in ("$defs", "definitions", "dependentSchemas", "patternProperties", "properties")
    }
)


def _child_kind(kind: int, key: Any) -> int:
    if kind == _TOOL:
        return _SCHEMA if key == "parameters" else _TOOL if key == "function" else _DATA
    if kind == _SCHEMA:
        return _SCHEMA_KEYWORDS.get(key, _DATA)
    if kind == _SCHEMA_MAP:
        return _SCHEMA
    return _DATA


def _sorted_value(value: Any, kind: int) -> Any:
    """``value`` with sorted keys; ``required`` sorted where ``kind`` says it is a schema."""
    if isinstance(value, Mapping):
        rebuilt = {key: _sorted_value(value[key], _child_kind(kind, key)) for key in sorted(value, key=str)}
        required = rebuilt.get("required")
        if kind == _SCHEMA and isinstance(required, list) and all(isinstance(item, str) for item in required):
            rebuilt["required"] = sorted(required)
        return rebuilt
    if isinstance(value, list):
        item_kind = _SCHEMA if kind in (_SCHEMA, _SCHEMAS) else _DATA  # "items" may be a list of schemas
        return [_sorted_value(item, item_kind) for item in value]
    return value
