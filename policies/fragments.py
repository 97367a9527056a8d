"""Dynamic-fragment detectors: named rules that find per-request values in prompt text.

A *fragment* is a short, single-line value that changes from request to request (a timestamp, a
UUID, a request id …) and so breaks prefix reuse wherever it sits. Rules are plain data in a registry
(``BUILTIN_RULES``); tenants add their own regular expressions, validated by
``compile_tenant_rules`` so that a tenant pattern can neither fail at request time nor take the
gateway's event loop hostage: tenant patterns run on RE2 (``google-re2``, linear time, no lookarounds or
back-references), after the static checks of ``policies.pattern_safety``. Scanning is linear in the
text too: ``stable_fragments`` re-scans at most ``MAX_RESCAN_ROUNDS`` times.

False positives are kept down on purpose: dates need a four-digit year in 1900–2099 and valid
month/day numbers; version numbers (``3.11.7``, calendar versions ``2024.1.15``) are never dates;
plain numbers are never matched (epoch seconds/milliseconds only right after a label such as
``timestamp:``); hexadecimal ids need 16+ characters of one case mixing digits and letters, so words
and short hashes such as colours stay put.

Speed: every built-in pattern starts with a character class or literal (its left-edge check is a
lookbehind placed after the first character), which lets ``re`` skip non-candidate positions in C;
numeric ranges that would break that shape are checked by the rule's ``accept`` predicate.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import re2

from policies.chat_text import PLACEHOLDER  # left where a value was moved; never matched by a rule
from policies.pattern_safety import MAX_MATCH_CHARS, check_pattern_safety

MAX_FRAGMENT_CHARS = MAX_MATCH_CHARS  # a fragment is a short value; longer matches are ignored
MAX_TENANT_RULES = 16
MAX_TENANT_PATTERN_CHARS = 256
TENANT_RULE_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")

_MASK = "[[0]]"  # stands for any placeholder while matching is repeated
_RESCAN_MARGIN = 1536  # text re-scanned on each side of a new placeholder (≥ 2 matches + lookarounds)
_RESCAN_GUARD = 512  # matches this close to a re-scan window's cut are not trusted
_LABEL_CONTEXT = 48  # characters before a value searched for its ``preceded_by`` label
# Re-scan rounds after masking: real prompts need one or two. A chain where each placeholder enables
# the next match ((?<!b)ab over "abab…") needs one round per fragment, each O(text): quadratic. Past the
# cap, the remaining chain stays in place (it only costs that tenant some reuse of its own prompt).
MAX_RESCAN_ROUNDS = 4
# Fragments one request may have: real prompts carry a handful of dynamic values, not thousands. A 1 MB
# text of "1:11:11 " holds 125,000 of them and cost 4-6 s of CPU to canonicalize (the rules' Python
# checks run per match), so one tenant could occupy the gateway's CPU pool. Past the budget, matching
# stops: fragments are found from the start of the prompt up to where the budget ran out, the rest of
# the text stays as it is (reported as ``fragment_limit_reached``). Each rule examines at most
# ``_EXAMINED_PER_FRAGMENT`` times the budget of regex matches (matches its checks reject count too).
MAX_FRAGMENTS_PER_REQUEST = 1024
_EXAMINED_PER_FRAGMENT = 4
# ``re`` holds the GIL for a whole search: one ``finditer`` step over 1 MB without a match held it for
# ~100 ms, stalling the event loop and every other tenant's thread. Long texts are searched in windows of
# ``_SCAN_WINDOW`` characters that overlap by a match and its lookahead (each at most MAX_MATCH_CHARS), so
# a match starting in a window is found whole, exactly as in one search, and the GIL is free between them.
_SCAN_WINDOW = 1 << 15
_SCAN_OVERLAP = 2 * MAX_MATCH_CHARS + 16


@dataclass(frozen=True, kw_only=True, slots=True)
class FragmentRule:
    """One named detector.

    If the pattern has a group named ``v``, only that group is the fragment (the rest of the match
    is context and stays in place). ``preceded_by`` must match the text right before the value
    (searched in the preceding ``_LABEL_CONTEXT`` characters, anchored with ``\\Z``); ``accept``
    vets the value's text (numeric ranges).
    """

    name: str
    kind: str  # what the value is: timestamp, date, time, epoch, uuid, trace_id, hex_id, request_id, tenant
    pattern: re.Pattern[str] | re2._Regexp  # built-ins use re, tenant patterns RE2
    preceded_by: re.Pattern[str] | None = None
    accept: Callable[[str], bool] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class FragmentSpan:
    """A fragment found in one text: ``text[start:end]``."""

    rule: str
    kind: str
    start: int
    end: int


def _rule(name: str, kind: str, pattern: str, **options) -> FragmentRule:
    preceded_by = options.pop("preceded_by", None)
    return FragmentRule(
        name=name,
        kind=kind,
        pattern=re.compile(pattern),
        preceded_by=re.compile(preceded_by) if preceded_by else None,
        **options,
    )


def _leading_numbers(value: str, count: int) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", value)[:count]]


def _day_month(value: str) -> bool:
    day, month = _leading_numbers(value, 2)
    return 1 <= day <= 31 and 1 <= month <= 12


def _either_order(value: str) -> bool:  # 11/29/2026 or 29/11/2026
    a, b = _leading_numbers(value, 2)
    return 1 <= a <= 31 and 1 <= b <= 31 and min(a, b) <= 12


def _hour_24(value: str) -> bool:
    return _leading_numbers(value, 1)[0] <= 23


def _hour_12(value: str) -> bool:
    return 1 <= _leading_numbers(value, 1)[0] <= 12


def _day(value: str) -> bool:
    return 1 <= _leading_numbers(value, 1)[0] <= 31


def _mixed_hex(value: str) -> bool:  # one case, at least one digit and one letter
    return value in (value.lower(), value.upper()) and _has_digit(value) and not value.isdigit()


def _has_digit(value: str) -> bool:
    return any(c.isdigit() for c in value)


_EDGE = r"(?<![0-9A-Za-z].)"  # after the first character: the one before it is not alphanumeric
_R = r"(?![0-9A-Za-z])"
_YEAR = r"(?:19|20)\d\d"
_YEAR_FIRST = r"[12](?<![0-9A-Za-z].)(?:(?<=1)9|(?<=2)0)\d\d"  # a year that opens a match
_MONTH = r"(?:0[1-9]|1[0-2])"
_DAY = r"(?:0[1-9]|[12]\d|3[01])"
_DAY1 = r"(?:0?[1-9]|[12]\d|3[01])"
_HMS = r"(?:[01]\d|2[0-3]):[0-5]\d(?::(?:[0-5]\d|60)(?:[.,]\d{1,9})?)?"
_TZ = r"(?:Z|[+-](?:[01]\d|2[0-3]):?[0-5]\d)"
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September")
_MONTHS += ("October", "November", "December")
_MON = "(?:" + "|".join(f"{m[:3]}(?:{m[3:]})?" if len(m) > 3 else m for m in _MONTHS) + "|Sept)"
_MON3 = "(?:" + "|".join(m[:3] for m in _MONTHS) + ")"
# a month name that opens a match: its first letter, the edge check, then the rest of a real name
_MON_FIRST = (
    f"[{''.join(sorted({m[0] for m in _MONTHS}))}]{_EDGE}(?:"
    + "|".join(f"(?<={m[0]}){m[1:3]}(?:{m[3:]})?" if len(m) > 3 else f"(?<={m[0]}){m[1:]}" for m in _MONTHS)
    + "|(?<=S)ept)"
)
_WEEKDAY_FIRST = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)(?<![0-9A-Za-z]...)"
_ORD = r"(?:st|nd|rd|th)?"
_LABEL_SEP = r"[\"']?[ \t]{0,2}[:=][ \t]{0,2}[\"']?"
_HEX = "[0-9a-fA-F]"

# Order matters only between matches that start at the same character and have the same length.
BUILTIN_RULES: Mapping[str, FragmentRule] = {
    r.name: r
    for r in (
        _rule("iso8601", "timestamp", rf"{_YEAR_FIRST}-{_MONTH}-{_DAY}[T ]{_HMS}{_TZ}?{_R}"),
        _rule("iso8601_basic", "timestamp", rf"{_YEAR_FIRST}{_MONTH}{_DAY}T[0-2]\d[0-5]\d[0-5]\dZ?{_R}"),
        _rule(
            "rfc2822",
            "timestamp",
            rf"{_WEEKDAY_FIRST}, {_DAY1} {_MON3} {_YEAR} {_HMS}"
            rf"(?: (?:[+-]\d{{4}}|GMT|UTC?|[ECMP][SD]T))?{_R}",
        ),
        _rule("ctime", "timestamp", rf"{_WEEKDAY_FIRST} {_MON3} [ 0-3]\d {_HMS} {_YEAR}{_R}"),
        _rule("date_iso", "date", rf"{_YEAR_FIRST}-{_MONTH}-{_DAY}{_R}"),
        _rule("date_ymd_slash", "date", rf"[12](?<![\w/].)(?:(?<=1)9|(?<=2)0)\d\d/{_MONTH}/{_DAY}(?![\w/])"),
        _rule("date_slash", "date", rf"\d(?<![\w/].)\d?/\d\d?/{_YEAR}(?![\w/])", accept=_either_order),
        _rule("date_dots", "date", rf"\d(?<![\w.].)\d?\.\d\d?\.{_YEAR}(?!\w|\.\d)", accept=_day_month),
        _rule(
            "date_weekday_name",
            "date",
            rf"{_WEEKDAY_FIRST}[a-z]{{0,6}},? "
            rf"(?:{_MON}\.? {_DAY1}{_ORD},? {_YEAR}|{_DAY1}{_ORD} {_MON}\.?,? {_YEAR}){_R}",
        ),
        _rule("date_month_name", "date", rf"{_MON_FIRST}\.? {_DAY1}{_ORD},? {_YEAR}{_R}"),
        _rule("date_day_name", "date", rf"\d{_EDGE}\d?{_ORD} {_MON}\.?,? {_YEAR}{_R}", accept=_day),
        _rule(
            "time",
            "time",
            r"\d(?<![\w:].)\d?:[0-5]\d:[0-5]\d(?:[.,]\d{1,9})?"
            r"(?: ?(?:AM|PM|am|pm))?(?: ?(?:Z|UTC|GMT|[+-]\d\d:?\d\d))?(?!:\d|\w)",
            accept=_hour_24,
        ),
        _rule("time_ampm", "time", r"\d(?<![\w:].)\d?:[0-5]\d ?(?:AM|PM|am|pm)(?!\w)", accept=_hour_12),
        _rule(
            "epoch",
            "epoch",
            r"1(?<![\w.].)\d{9}(?:\d{3})?(?:\.\d{1,6})?(?![\w.])",
            preceded_by=r"(?i:\b(?:timestamp|datetime|time|ts|epoch|created(?:_at)?|updated(?:_at)?|date|now))"
            rf"{_LABEL_SEP}\Z",
        ),
        _rule("uuid", "uuid", rf"{_HEX}(?<![\w-].){_HEX}{{7}}(?:-{_HEX}{{4}}){{3}}-{_HEX}{{12}}(?![\w-])"),
        _rule("traceparent", "trace_id", r"0(?<![\w-].)0-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(?![\w-])"),
        _rule(
            "prefixed_id",
            "request_id",
            r"(?<![\w-])(?:req|request|trace|span|corr|session|sess|msg|run|call|chatcmpl|resp|evt|job|txn)"
            r"[_-][A-Za-z0-9]{6,64}(?![\w-])",
            accept=_has_digit,
        ),
        _rule(
            "labeled_id",
            "request_id",
            r"\b(?=[xXrRtTsScCmMuU])(?i:(?:x-)?(?:request|req|trace|span|correlation|session|transaction|txn"
            r"|message|msg|conversation|run|user)[-_ ]?id\b)"
            rf"{_LABEL_SEP}(?P<v>[\w-](?:[\w.:-]{{0,62}}[\w-])?)(?![\w-])",
            accept=_has_digit,
        ),
        _rule("hex_id", "hex_id", rf"{_HEX}(?<![\w-].){_HEX}{{15,63}}(?![\w-])", accept=_mixed_hex),
    )
}


def _matches(pattern: Any, text: str) -> Iterator[Any]:
    """``pattern.finditer(text)``, searched window by window (``_SCAN_WINDOW``)."""
    if len(text) <= _SCAN_WINDOW + _SCAN_OVERLAP:
        yield from pattern.finditer(text)
        return
    pos = 0
    while pos < len(text):
        window_end = min(len(text), pos + _SCAN_WINDOW)
        next_pos = window_end
        for match in pattern.finditer(text, pos, min(len(text), window_end + _SCAN_OVERLAP)):
            if match.start() >= window_end:
                break
            yield match
            next_pos = max(window_end, match.end())
        pos = next_pos


def find_fragments(
    text: str, rules: Iterable[FragmentRule], *, limit: int | None = None
) -> list[FragmentSpan]:
    """Non-overlapping fragments of ``text``, ordered by position.

    Where matches overlap, the one that starts first wins, then the longest, then the earlier rule.
    Matches that overlap a placeholder (``[[n]]``, left by an earlier canonicalization), span a line
    break or exceed ``MAX_FRAGMENT_CHARS`` are ignored, so the result is stable under re-application.

    With a ``limit``, at most that many, the first ones: a rule stops after examining
    ``_EXAMINED_PER_FRAGMENT * limit`` matches, and only candidates before the earliest such stop (where
    every rule's matches are known) are kept, so the result is the same as an unlimited scan's first ones.
    """
    protected = [m.span() for m in PLACEHOLDER.finditer(text)] if "[[" in text else []
    candidates: list[tuple[int, int, int, int, FragmentRule]] = []
    horizon = len(text) + 1  # candidates starting before it are complete across rules
    max_examined = None if limit is None else _EXAMINED_PER_FRAGMENT * max(limit, 1)
    for order, rule in enumerate(rules):
        has_value_group = "v" in rule.pattern.groupindex
        for examined, match in enumerate(_matches(rule.pattern, text)):
            if max_examined is not None and (match.start() >= horizon or examined >= max_examined):
                horizon = min(horizon, match.start())
                break
            start, end = match.span(rule.pattern.groupindex["v"]) if has_value_group else match.span()
            value = text[start:end]
            if not value or len(value) > MAX_FRAGMENT_CHARS or "\n" in value or "\r" in value:
                continue
            if rule.accept is not None and not rule.accept(value):
                continue
            if rule.preceded_by is not None and not rule.preceded_by.search(
                text, max(0, start - _LABEL_CONTEXT), start
            ):
                continue
            if protected and any(ps < match.end() and match.start() < pe for ps, pe in protected):
                continue
            candidates.append((start, -(end - start), order, end, rule))
    candidates.sort(key=lambda c: c[:3])
    spans: list[FragmentSpan] = []
    taken_to = 0
    for start, _, _, end, rule in candidates:
        if start >= horizon or (limit is not None and len(spans) >= limit):
            break
        if start >= taken_to:
            spans.append(FragmentSpan(rule=rule.name, kind=rule.kind, start=start, end=end))
            taken_to = end
    return spans


def stable_fragments(
    text: str, rules: Sequence[FragmentRule], *, limit: int | None = None
) -> list[FragmentSpan]:
    """Fragments of ``text`` such that, once each is replaced by a placeholder, no rule matches again.

    Replacing a fragment changes its neighbours' context (a boundary that failed may now succeed,
    a match hidden behind an overlapping one may appear), so matching is repeated on the masked text
    until nothing new is found; this is what makes canonicalization idempotent. A new match can only
    appear near a new placeholder, so only windows around those are re-scanned. Each round adds at
    least one disjoint span; after ``MAX_RESCAN_ROUNDS`` rounds it stops, which keeps it linear in the
    text on adversarial input (where the result may then not be idempotent). With a ``limit``, at most
    that many (``find_fragments``); re-scans stop once it is reached.
    """
    spans = find_fragments(text, rules, limit=limit)
    new = spans
    for _ in range(MAX_RESCAN_ROUNDS):
        if not new or (limit is not None and len(spans) >= limit):
            break
        masked, masks = _mask(text, spans)
        fresh = {(s.start, s.end) for s in new}
        windows = _merge(
            (max(0, ms - _RESCAN_MARGIN), min(len(masked), me + _RESCAN_MARGIN))
            for span, (ms, me, _) in zip(spans, masks, strict=True)
            if (span.start, span.end) in fresh
        )
        new = []
        for lo, hi in windows:
            for span in find_fragments(masked[lo:hi], rules):
                if (lo and span.start < _RESCAN_GUARD) or (
                    hi < len(masked) and span.end > hi - lo - _RESCAN_GUARD
                ):
                    continue
                shift = _shift_at(lo + span.start, masks)
                new.append(replace(span, start=lo + span.start - shift, end=lo + span.end - shift))
        if limit is not None:
            new = sorted(new, key=lambda s: s.start)[: limit - len(spans)]
        spans = sorted(spans + new, key=lambda s: s.start)
    return spans


def _mask(text: str, spans: Sequence[FragmentSpan]) -> tuple[str, list[tuple[int, int, int]]]:
    """``text`` with each span replaced by ``_MASK``, and per span ``(masked start, masked end,
    total length change up to its end)``."""
    pieces: list[str] = []
    masks: list[tuple[int, int, int]] = []
    cursor = shift = 0
    for span in spans:
        pieces += [text[cursor : span.start], _MASK]
        masked_start = span.start + shift
        shift += len(_MASK) - (span.end - span.start)
        masks.append((masked_start, masked_start + len(_MASK), shift))
        cursor = span.end
    pieces.append(text[cursor:])
    return "".join(pieces), masks


def _shift_at(masked_pos: int, masks: Sequence[tuple[int, int, int]]) -> int:
    shift = 0
    for _, masked_end, total in masks:
        if masked_end > masked_pos:
            break
        shift = total
    return shift


def _merge(windows: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(windows):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _re2_options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False  # a bad tenant pattern is a 400, not a line on stderr
    options.max_mem = 8 << 20  # per compiled pattern
    return options


def compile_tenant_rules(patterns: Mapping[str, str]) -> tuple[FragmentRule, ...]:
    """Validate and compile a tenant's extra fragment patterns (name → regular expression).

    Raises:
        ValueError: with a message naming the pattern, if there are too many patterns, a name is
            invalid or shadows a built-in rule, a pattern does not compile, can match empty text, or
            could backtrack catastrophically (``policies.pattern_safety.check_pattern_safety``).
    """
    if len(patterns) > MAX_TENANT_RULES:
        raise ValueError(f"at most {MAX_TENANT_RULES} canonicalization patterns per tenant")
    rules = []
    for name, source in sorted(patterns.items()):
        if not isinstance(name, str) or not TENANT_RULE_NAME.fullmatch(name):
            raise ValueError(f"pattern name {name!r} must match {TENANT_RULE_NAME.pattern}")
        if name in BUILTIN_RULES:
            raise ValueError(f"pattern name {name!r} is a built-in rule")
        if not isinstance(source, str) or len(source) > MAX_TENANT_PATTERN_CHARS:
            raise ValueError(f"pattern {name!r} must be a string of at most {MAX_TENANT_PATTERN_CHARS} chars")
        try:
            re.compile(source)  # the static checks below read Python's parse of it
            compiled = re2.compile(source, _re2_options())
        except (re.error, re2.error) as exc:
            message = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else str(exc)
            raise ValueError(
                f"pattern {name!r} does not compile for the linear-time engine (RE2: no lookarounds, "
                f"no back-references): {message}"
            ) from None
        problem = check_pattern_safety(source)
        if problem:
            raise ValueError(f"pattern {name!r} rejected: {problem}")
        rules.append(FragmentRule(name=name, kind="tenant", pattern=compiled))
    return tuple(rules)
