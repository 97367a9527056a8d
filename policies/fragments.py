"""Dynamic-fragment detectors: named rules that find per-request values in prompt text.

A *fragment* is a short, single-line value that changes from request to request (a timestamp, a
UUID, a request id …) and so breaks prefix reuse wherever it sits. Rules are plain data in a registry
(``BUILTIN_RULES``); tenants add their own regular expressions, validated by
``compile_tenant_rules`` so that a tenant pattern can neither fail at request time nor take the
gateway's event loop hostage with catastrophic backtracking.

False positives are kept down on purpose: dates need a four-digit year in 1900–2099 and valid
month/day numbers; version numbers (``3.11.7``, calendar versions ``2024.1.15``) are never dates;
plain numbers are never matched (epoch seconds/milliseconds only after a label such as
``timestamp:``); hexadecimal ids need 16+ characters mixing digits and letters, so words and short
hashes such as colours stay put.
"""

from __future__ import annotations

import re
import re._constants as _sre  # the parser's opcodes; stable across 3.11–3.13
import re._parser as _sre_parse  # private, but the only way to inspect a pattern without running it
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

MAX_FRAGMENT_CHARS = 256  # a fragment is a short value; longer matches are ignored
MAX_TENANT_RULES = 16
MAX_TENANT_PATTERN_CHARS = 256
MAX_TENANT_REPEAT = 64  # largest upper bound of a repeat in a tenant pattern ({m,n} with n ≤ 64)
MAX_BACKTRACK_PRODUCT = 256  # bound on paths tried per start: ≲0.3 s per 100k adversarial chars
TENANT_RULE_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")

# Placeholders left where a fragment was moved out (see canonicalize.py). Never matched by a rule.
PLACEHOLDER = re.compile(r"\[\[(\d{1,6})\]\]")
_MASK = "[[0]]"  # stands for any placeholder while matching is repeated


@dataclass(frozen=True, kw_only=True, slots=True)
class FragmentRule:
    """One named detector. If the pattern has a group named ``v``, only that group is the fragment
    (the rest of the match is context, such as a ``timestamp:`` label, and stays in place)."""

    name: str
    kind: str  # what the value is: timestamp, date, time, epoch, uuid, trace_id, hex_id, request_id, tenant
    pattern: re.Pattern[str]


@dataclass(frozen=True, kw_only=True, slots=True)
class FragmentSpan:
    """A fragment found in one text: ``text[start:end]``."""

    rule: str
    kind: str
    start: int
    end: int


def _rule(name: str, kind: str, pattern: str) -> FragmentRule:
    return FragmentRule(name=name, kind=kind, pattern=re.compile(pattern))


_L = r"(?<![0-9A-Za-z])"  # left edge: not inside a word or number
_R = r"(?![0-9A-Za-z])"
_YEAR = r"(?:19|20)\d\d"
_MONTH = r"(?:0[1-9]|1[0-2])"
_DAY = r"(?:0[1-9]|[12]\d|3[01])"
_MONTH1 = r"(?:0?[1-9]|1[0-2])"
_DAY1 = r"(?:0?[1-9]|[12]\d|3[01])"
_HMS = r"(?:[01]\d|2[0-3]):[0-5]\d(?::(?:[0-5]\d|60)(?:[.,]\d{1,9})?)?"
_TZ = r"(?:Z|[+-](?:[01]\d|2[0-3]):?[0-5]\d)"
_MON = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
    r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)
_MON3 = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
_WEEKDAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_ORD = r"(?:st|nd|rd|th)?"
_LABEL_SEP = r"[\"']?[ \t]{0,2}[:=][ \t]{0,2}[\"']?"

# Order matters only between matches that start at the same character and have the same length.
BUILTIN_RULES: Mapping[str, FragmentRule] = {
    r.name: r
    for r in (
        _rule("iso8601", "timestamp", rf"{_L}{_YEAR}-{_MONTH}-{_DAY}[T ]{_HMS}{_TZ}?{_R}"),
        _rule("iso8601_basic", "timestamp", rf"{_L}{_YEAR}{_MONTH}{_DAY}T[0-2]\d[0-5]\d[0-5]\dZ?{_R}"),
        _rule(
            "rfc2822",
            "timestamp",
            rf"{_L}{_WEEKDAY}, {_DAY1} {_MON3} {_YEAR} {_HMS}(?: (?:[+-]\d{{4}}|GMT|UTC?|[ECMP][SD]T))?{_R}",
        ),
        _rule("ctime", "timestamp", rf"{_L}{_WEEKDAY} {_MON3} [ 0-3]\d {_HMS} {_YEAR}{_R}"),
        _rule("date_iso", "date", rf"{_L}{_YEAR}-{_MONTH}-{_DAY}{_R}"),
        _rule("date_ymd_slash", "date", rf"(?<![\w/]){_YEAR}/{_MONTH}/{_DAY}(?![\w/])"),
        _rule("date_slash", "date", rf"(?<![\w/]){_DAY1}/{_DAY1}/{_YEAR}(?![\w/])"),
        _rule("date_dots", "date", rf"(?<![\w.]){_DAY1}\.{_MONTH1}\.{_YEAR}(?!\w|\.\d)"),
        _rule(
            "date_month_name",
            "date",
            rf"{_L}(?:{_WEEKDAY}[a-z]{{0,6}},? )?(?:{_MON}\.? {_DAY1}{_ORD},? {_YEAR}"
            rf"|{_DAY1}{_ORD} {_MON}\.?,? {_YEAR}){_R}",
        ),
        _rule(
            "time",
            "time",
            r"(?<![\w:])(?:[01]?\d|2[0-3]):[0-5]\d:[0-5]\d(?:[.,]\d{1,9})?"
            r"(?: ?(?:AM|PM|am|pm))?(?: ?(?:Z|UTC|GMT|[+-]\d\d:?\d\d))?(?!:\d|\w)",
        ),
        _rule("time_ampm", "time", r"(?<![\w:])(?:0?[1-9]|1[0-2]):[0-5]\d ?(?:AM|PM|am|pm)(?!\w)"),
        _rule(
            "epoch",
            "epoch",
            r"(?i:\b(?:timestamp|time|ts|epoch|created(?:_at)?|updated(?:_at)?|date|now)\b)"
            rf"{_LABEL_SEP}(?P<v>1\d{{9}}(?:\d{{3}})?(?:\.\d{{1,6}})?)(?![\w.])",
        ),
        _rule("uuid", "uuid", r"(?<![\w-])[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}(?![\w-])"),
        _rule("traceparent", "trace_id", r"(?<![\w-])00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(?![\w-])"),
        _rule(
            "prefixed_id",
            "request_id",
            r"(?<![\w-])(?:req|request|trace|span|corr|session|sess|msg|run|call|chatcmpl|resp|evt|job|txn)"
            r"[_-](?=[A-Za-z0-9]{0,63}\d)[A-Za-z0-9]{6,64}(?![\w-])",
        ),
        _rule(
            "labeled_id",
            "request_id",
            r"(?i:\b(?:x-)?(?:request|req|trace|span|correlation|session|transaction|txn|message|msg"
            r"|conversation|run|user)[-_ ]?id\b)"
            rf"{_LABEL_SEP}(?P<v>(?=[\w.:-]{{0,63}}\d)[\w-](?:[\w.:-]{{0,62}}[\w-])?)(?![\w-])",
        ),
        _rule(
            "hex_id",
            "hex_id",
            r"(?<![\w-])(?:(?=[0-9a-f]{0,63}\d)(?=[0-9a-f]{0,63}[a-f])[0-9a-f]{16,64}"
            r"|(?=[0-9A-F]{0,63}\d)(?=[0-9A-F]{0,63}[A-F])[0-9A-F]{16,64})(?![\w-])",
        ),
    )
}


def find_fragments(text: str, rules: Iterable[FragmentRule]) -> list[FragmentSpan]:
    """Non-overlapping fragments of ``text``, ordered by position.

    Where matches overlap, the one that starts first wins, then the longest, then the earlier rule.
    Matches that overlap a placeholder (``[[n]]``, left by an earlier canonicalization), span a line
    break or exceed ``MAX_FRAGMENT_CHARS`` are ignored, so the result is stable under re-application.
    """
    protected = [m.span() for m in PLACEHOLDER.finditer(text)]
    candidates: list[tuple[int, int, int, int, int, FragmentRule]] = []
    for order, rule in enumerate(rules):
        for match in rule.pattern.finditer(text):
            start, end = match.span("v") if "v" in rule.pattern.groupindex else match.span()
            outer_start, outer_end = match.span()
            value = text[start:end]
            if not value or len(value) > MAX_FRAGMENT_CHARS or "\n" in value or "\r" in value:
                continue
            if any(ps < outer_end and outer_start < pe for ps, pe in protected):
                continue
            candidates.append((start, -(end - start), order, end, outer_start, rule))
    candidates.sort(key=lambda c: c[:3])
    spans: list[FragmentSpan] = []
    taken_to = 0
    for start, _, _, end, _, rule in candidates:
        if start >= taken_to:
            spans.append(FragmentSpan(rule=rule.name, kind=rule.kind, start=start, end=end))
            taken_to = end
    return spans


def stable_fragments(text: str, rules: Sequence[FragmentRule]) -> list[FragmentSpan]:
    """Fragments of ``text`` such that, once each is replaced by a placeholder, no rule matches again.

    Replacing a fragment changes its neighbours' context (a boundary that failed may now succeed),
    so matching is repeated on the masked text until nothing new is found; this is what makes
    canonicalization idempotent. Each round adds at least one disjoint span, so it terminates.
    """
    spans = find_fragments(text, rules)
    found = spans
    while found:
        masked, starts = _mask(text, spans)
        found = []
        for span in find_fragments(masked, rules):
            shift = _shift_at(span.start, starts)
            found.append(replace(span, start=span.start - shift, end=span.end - shift))
        spans = sorted(spans + found, key=lambda s: s.start)
    return spans


def _mask(text: str, spans: Sequence[FragmentSpan]) -> tuple[str, list[tuple[int, int]]]:
    """``text`` with each span replaced by ``_MASK``; ``(masked end of each mask, total shift after it)``."""
    pieces: list[str] = []
    marks: list[tuple[int, int]] = []
    cursor = 0
    shift = 0
    for span in spans:
        pieces += [text[cursor : span.start], _MASK]
        shift += len(_MASK) - (span.end - span.start)
        marks.append((span.start + shift + (span.end - span.start), shift))
        cursor = span.end
    pieces.append(text[cursor:])
    return "".join(pieces), marks


def _shift_at(masked_pos: int, marks: Sequence[tuple[int, int]]) -> int:
    shift = 0
    for masked_end, total in marks:
        if masked_end > masked_pos:
            break
        shift = total
    return shift


def compile_tenant_rules(patterns: Mapping[str, str]) -> tuple[FragmentRule, ...]:
    """Validate and compile a tenant's extra fragment patterns (name → regular expression).

    Raises:
        ValueError: with a message naming the pattern, if there are too many patterns, a name is
            invalid or shadows a built-in rule, a pattern does not compile, can match empty text, or
            could backtrack catastrophically (see ``check_pattern_safety``).
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
            compiled = re.compile(source)
        except re.error as exc:
            raise ValueError(f"pattern {name!r} does not compile: {exc}") from None
        problem = check_pattern_safety(source)
        if problem:
            raise ValueError(f"pattern {name!r} rejected: {problem}")
        rules.append(FragmentRule(name=name, kind="tenant", pattern=compiled))
    return tuple(rules)


def check_pattern_safety(source: str, *, max_cost: int = MAX_BACKTRACK_PRODUCT) -> str | None:
    """Why ``source`` is unsafe to run on untrusted text, or None if it is acceptable.

    Python's ``re`` backtracks and has no timeout, so safety is decided on the parsed pattern:
    every repeat is bounded (``{m,n}``, n ≤ ``MAX_TENANT_REPEAT``; no ``*``, ``+``, ``{m,}``), so a
    search costs at most a bounded amount per starting position; a repeat that may iterate holds only
    fixed-width bodies without alternation (``(a|ab){1,9}``, ``(x{1,3}){1,9}`` are the exponential
    shapes) unless the body is atomic or the repeat possessive; the product of repeat ranges along a
    path stays under ``max_cost``; no back-references; no empty matches; a match is
    at most ``MAX_FRAGMENT_CHARS`` long.
    """
    tree = _sre_parse.parse(source)
    try:
        cost = _path_cost(tree, max_cost)
    except _UnsafePattern as exc:
        return str(exc)
    if cost > max_cost:
        return f"too many ambiguous repeats in a row (backtracking bound {cost} > {max_cost})"
    low, high = tree.getwidth()
    if low == 0:
        return "it can match empty text"
    if high > MAX_FRAGMENT_CHARS:
        return f"it can match more than {MAX_FRAGMENT_CHARS} characters"
    return None


class _UnsafePattern(Exception):
    pass


_REPEATS = (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT)


def _path_cost(items: Sequence, max_cost: int) -> int:
    """Bound on the paths a match attempt may try from one position; raises _UnsafePattern on an
    unsafe shape.

    A repeat multiplies by its range; an alternation of fixed-width branches (``0[1-9]|1[0-2]``)
    fails or succeeds within its width and multiplies by its costliest branch, other alternations by
    the sum of their branches. Lookarounds and atomic groups never backtrack into their body once
    done, so their bodies are checked as separate scopes and count 1 for the enclosing path.
    """
    cost = 1
    for op, av in items:
        if op in _REPEATS:
            low, high, body = av
            if high == _sre.MAXREPEAT or high > MAX_TENANT_REPEAT:
                raise _UnsafePattern(f"unbounded repeat; write {{m,n}} with n ≤ {MAX_TENANT_REPEAT}")
            if op == _sre.POSSESSIVE_REPEAT:
                _check_scope(body, max_cost)
                continue
            width_low, width_high = body.getwidth()
            if high > 1 and not _is_atomic(body) and (width_low != width_high or _has_branch(body)):
                raise _UnsafePattern(
                    "a repeat over a variable-width or alternating body (nested quantifiers); "
                    "make the body atomic (?>…) or the repeat possessive"
                )
            cost *= (high - low + 1) * _path_cost(body, max_cost)
        elif op == _sre.SUBPATTERN:
            cost *= _path_cost(av[3], max_cost)
        elif op == _sre.BRANCH:
            costs = [_path_cost(branch, max_cost) for branch in av[1]]
            fixed = all(branch.getwidth()[0] == branch.getwidth()[1] for branch in av[1])
            cost *= max(costs) if fixed else sum(costs)
        elif op == _sre.ATOMIC_GROUP:
            _check_scope(av, max_cost)
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
            _check_scope(av[1], max_cost)
        elif op in (_sre.GROUPREF, _sre.GROUPREF_EXISTS):
            raise _UnsafePattern("back-references and conditionals are not allowed")
    return cost


def _check_scope(items: Sequence, max_cost: int) -> None:
    if _path_cost(items, max_cost) > max_cost:
        raise _UnsafePattern("a lookaround, atomic group or possessive repeat is too ambiguous")


def _is_atomic(items: Sequence) -> bool:
    if len(items) != 1:
        return False
    op, av = items[0]
    return op == _sre.ATOMIC_GROUP or (op == _sre.SUBPATTERN and _is_atomic(av[3]))


def _has_branch(items: Sequence) -> bool:
    for op, av in items:
        if op == _sre.BRANCH:
            return True
        if op == _sre.SUBPATTERN and _has_branch(av[3]):
            return True
        if op in _REPEATS and _has_branch(av[2]):
            return True
    return False
