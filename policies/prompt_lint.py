"""Prompt lint: what in a chat request breaks prefix reuse, and what it costs in prompt tokens.

Backs ``POST /v1/prompt-lint``. The caller injects the two things that know the model: ``render``
(the chat template applied to a request, without the generation prompt) and ``token_starts`` (the
character offset where each token the worker's tokenizer makes of a rendered text starts). Positions
are found with one marked render (``policies.chat_text``) and turned into token counts by bisection
over one tokenization, so linting costs three renders and two tokenizations whatever the number of
fragments: linear in the input (tokenizing once per fragment made 400 KB take 30 s).

"Reuse it costs": prefix caching reuses a prompt up to its first difference from a cached one. A
dynamic fragment differs on every request, so every cacheable token after the first one is
recomputed each time: ``reuse_cost_tokens = cacheable_tokens - reusable_tokens``, where the
cacheable part ends where the last user message's text starts.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from policies.canonicalize import (
    CanonicalizationPolicy,
    Fragment,
    WhitespaceChange,
    canonicalize_request,
    split_note,
)
from policies.chat_text import TextPosition, cacheable_end, insert_markers, iter_texts, locate_markers

Renderer = Callable[[Mapping[str, Any]], str]  # chat request → prompt text, no generation prompt
TokenStarts = Callable[[str], Sequence[int]]  # rendered text → sorted character start of each token
MAX_LOCATED_FRAGMENTS = 64  # fragments given a token offset; later ones are still listed


@dataclass(frozen=True, kw_only=True, slots=True)
class LintFinding:
    """A fragment and where it sits in the rendered prompt."""

    fragment: Fragment
    token_offset: int | None  # prompt tokens before it; None if it could not be located
    reuse_cost_tokens: int | None  # cacheable tokens after it, recomputed on every request


@dataclass(frozen=True, kw_only=True, slots=True)
class LintReport:
    """The lint answer. Holds the tenant's own prompt text: return it to that tenant only."""

    mode: str  # the tenant's canonicalization mode now
    findings: tuple[LintFinding, ...]  # in prompt order
    first_breaking: LintFinding | None
    prompt_tokens: int  # the whole rendered request (no generation prompt)
    cacheable_tokens: int  # tokens before the last user message's text
    reusable_tokens: int | None  # cacheable tokens before the first breaking fragment (None: unknown)
    reuse_cost_tokens: int | None  # cacheable_tokens - reusable_tokens
    canonical_cacheable_tokens: int | None  # the stable part with canonicalization "on"
    num_movable: int  # fragments "on" would move (the x-prefixgate-canonicalized value)
    whitespace: tuple[WhitespaceChange, ...]
    tools_changed: bool
    suggested_rules: tuple[str, ...]  # rules that fired; "tools"/"whitespace" when those would change
    exact: bool  # False when the template reacted to position markers and offsets are unknown

    def to_json(self) -> dict[str, Any]:
        first = self.findings.index(self.first_breaking) if self.first_breaking else None
        return {
            "mode": self.mode,
            "fragments": [
                {
                    **f.fragment.to_json(),
                    "token_offset": f.token_offset,
                    "reuse_cost_tokens": f.reuse_cost_tokens,
                }
                for f in self.findings
            ],
            "first_breaking_fragment": first,
            "prompt_tokens": self.prompt_tokens,
            "cacheable_tokens": self.cacheable_tokens,
            "reusable_tokens": self.reusable_tokens,
            "reuse_cost_tokens": self.reuse_cost_tokens,
            "canonical_cacheable_tokens": self.canonical_cacheable_tokens,
            "would_move": self.num_movable,
            "whitespace": [w.to_json() for w in self.whitespace],
            "tools_changed": self.tools_changed,
            "suggested_rules": list(self.suggested_rules),
            "exact": self.exact,
        }


def lint_prompt(
    request: Mapping[str, Any],
    *,
    policy: CanonicalizationPolicy,
    render: Renderer,
    token_starts: TokenStarts,
) -> LintReport:
    """Lint one chat request with the tenant's rules (as if its mode were ``on``).

    Raises whatever ``render`` raises for a request the template rejects.
    """
    canonical = canonicalize_request(request, replace(policy, mode="on"))
    fragments = canonical.report.fragments
    messages = list(request.get("messages") or [])
    plain_text = render(request)
    starts = token_starts(plain_text)
    prompt_tokens = len(starts)
    positions = [
        TextPosition(message_index=f.message_index, part_index=f.part_index, offset=f.start)
        for f in fragments[:MAX_LOCATED_FRAGMENTS]
    ]
    end_position = _cacheable_end_position(messages)
    located = _locate(request, plain_text, [*positions, end_position] if end_position else positions, render)
    exact = located is not None
    located = located or [None] * (len(positions) + (1 if end_position else 0))
    if end_position is None:
        cacheable_tokens = prompt_tokens
    else:
        end_char = located.pop()
        cacheable_tokens = prompt_tokens if end_char is None else bisect_left(starts, end_char)
    findings = []
    for index, fragment in enumerate(fragments):
        char = located[index] if index < len(located) else None
        offset = None if char is None else bisect_left(starts, char)
        cost = None if offset is None else max(0, cacheable_tokens - offset)
        findings.append(LintFinding(fragment=fragment, token_offset=offset, reuse_cost_tokens=cost))
    first = findings[0] if findings else None  # fragments come in prompt order
    reusable = cacheable_tokens if first is None else first.token_offset
    reusable = None if reusable is None else min(reusable, cacheable_tokens)
    suggested = list(canonical.report.rules_fired)
    suggested += ["tools"] if canonical.report.tools_changed else []
    suggested += ["whitespace"] if canonical.report.whitespace else []
    return LintReport(
        mode=policy.mode,
        findings=tuple(findings),
        first_breaking=first,
        prompt_tokens=prompt_tokens,
        cacheable_tokens=cacheable_tokens,
        reusable_tokens=reusable,
        reuse_cost_tokens=None if reusable is None else cacheable_tokens - reusable,
        canonical_cacheable_tokens=_canonical_cacheable_tokens(canonical.request, render, token_starts),
        num_movable=canonical.report.num_moved,
        whitespace=canonical.report.whitespace,
        tools_changed=canonical.report.tools_changed,
        suggested_rules=tuple(suggested),
        exact=exact,
    )


def _cacheable_end_position(messages: list[Any]) -> TextPosition | None:
    """Where the last user message's text starts (after leading whitespace).

    None without a user message (all of the prompt is cacheable) or when it has no text (then the
    whole prompt is counted, an upper bound).
    """
    end = cacheable_end(messages)
    for message_index, part_index, text in iter_texts(messages):
        if message_index == end:
            lead = len(text) - len(text.lstrip())
            return TextPosition(message_index=message_index, part_index=part_index, offset=lead)
    return None


def _locate(
    request: Mapping[str, Any], plain_text: str, positions: list[TextPosition], render: Renderer
) -> list[int | None] | None:
    """Character offsets of ``positions`` in ``plain_text`` (the render of ``request``)."""
    if not positions:
        return []
    marked = render({**request, "messages": insert_markers(list(request.get("messages") or []), positions)})
    return locate_markers(marked, plain_text, len(positions))


def _canonical_cacheable_tokens(
    request: Mapping[str, Any], render: Renderer, token_starts: TokenStarts
) -> int | None:
    body, _ = split_note(list(request.get("messages") or []))  # the note comes after the user turn
    plain_text = render(request)
    position = _cacheable_end_position(body)
    if position is None:
        return len(token_starts(plain_text))
    located = _locate(request, plain_text, [position], render)
    if not located or located[0] is None:
        return None
    return bisect_left(token_starts(plain_text[: located[0]]), located[0])
